"""Trained models as MLflow Models and their versions in the MLflow Model Registry.

- ``cli``: ``python -m runtime models list|show|promote|register``, the registry for operators.
- ``evaluate``: a trained model's held-out metrics (the pipeline's ``evaluate`` step), and the check
  that a registered model loaded back by alias reproduces them.

A run's final checkpoint becomes an MLflow PyTorch model in ``runtime.train.export`` (signature,
input example, resolved config, class names, source checkpoint); versions, aliases and the promotion
rule, shared by the end of a run, these commands and the Metaflow flow, are ``runtime.observe.registry``.
This package is the MLflow side of models; the networks themselves are ``runtime.train.model_zoo``.
"""
