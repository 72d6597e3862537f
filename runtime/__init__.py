"""Distributed training runtime: PyTorch DDP/FSDP and Ray Tune on a Ray cluster.

Entry points: ``python -m runtime train jobs/resnet50.yaml`` (CLI), or from
Python ``runtime.launch.train(config)`` / ``runtime.tune.tune(config)``.
"""

__version__ = "0.1.0"

# Ray reads its authentication settings once, when first imported: point this process at the
# local cluster's token (if `make cluster-up` made one) before anything imports Ray.
from runtime.cluster import use_cluster_auth as _use_cluster_auth  # noqa: E402

_use_cluster_auth()
