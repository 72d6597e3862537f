"""Distributed training runtime: PyTorch DDP/FSDP and Ray Tune on a Ray cluster.

Entry points: ``python -m runtime train jobs/resnet50.yaml`` (CLI), or from
Python ``runtime.launch.train(config)`` / ``runtime.tune.tune(config)``.
"""

__version__ = "0.1.0"
