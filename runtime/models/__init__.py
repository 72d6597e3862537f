"""Trained models as MLflow Models and their versions in the MLflow Model Registry (issue 30).

``export``: the final checkpoint of a run as an MLflow PyTorch model (signature, input example,
resolved config, class names, source checkpoint). ``registry``: versions, aliases and the promotion
rule, shared by the end of a run, ``python -m runtime models`` and the Metaflow flow.
"""
