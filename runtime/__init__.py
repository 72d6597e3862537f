"""Distributed training runtime: PyTorch DDP/FSDP and Ray Tune on a Ray cluster.

Entry points: ``python -m runtime train jobs/resnet50.yaml`` (CLI), or from Python (docs/python-api.md)::

    from runtime.config import load_job
    from runtime.launch.driver import train

    outcome = train(load_job("digits_smoke", ["train.max_steps=20"]))

Importing the package reads and writes no environment variables: ``load_job`` reads RT_*
overrides only when given ``environ=``, and the local cluster's token is put in the
environment only when a run connects to that cluster.
"""

__version__ = "0.1.0"
