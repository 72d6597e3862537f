"""The final checkpoint of a run as an MLflow PyTorch model.

Here, in the layer that builds networks; tracking (below) is handed ``save_final_model`` by the
driver and the ``models`` commands.

A checkpoint holds a bare state_dict; a team serving the model needs more: the network itself, what
it takes (shape, dtype, normalisation), what its outputs mean (class names) and where it came from.
The network is saved with ``torch.export`` (MLflow's ``pt2`` format): loading it needs torch only,
not this package's model classes, so a model registered today still loads after runtime/ is
reorganised. A network torch.export cannot capture is pickled instead (MLflow's default), and then
needs ``runtime`` importable where it is loaded.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from runtime.config import JobConfig

log = logging.getLogger("runtime.train.export")

EXAMPLE_ROWS = 2  # samples in the input example (a batch: the signature's first axis is the batch)


@dataclass
class FinalModel:
    """A run's final weights in their network, ready for inference, with what describes them."""

    module: nn.Module
    example: np.ndarray  # model input, already normalised as the training step normalises it
    step: int
    checkpoint: str  # the checkpoint folder's URI the weights came from
    classes: list[str] | None
    metadata: dict[str, Any]


def final_model(checkpoint_uri: str, cfg: JobConfig) -> FinalModel | None:
    """The newest valid checkpoint under ``checkpoint_uri`` as a network in eval mode; None without one."""
    from runtime.checkpoint import CheckpointReader

    reader = CheckpointReader(checkpoint_uri, endpoint_url=cfg.checkpoint.endpoint_url,
                              s3_retry_s=cfg.checkpoint.s3_retry_s)
    ref, payload, _ = reader.load_latest()
    if ref is None or payload is None:
        return None
    meta = reader.read_meta(ref)
    classes = meta.get("classes")
    module, example, inputs = _network(cfg, classes)
    module.load_state_dict(payload["model"])
    module.eval()
    metadata = {"job": cfg.name, "step": ref.step, "checkpoint": ref.uri, "config_hash": cfg.config_hash(),
                "input": inputs, "classes": classes}
    return FinalModel(module, example, ref.step, ref.uri, classes, metadata)


def _network(cfg: JobConfig, classes: list[str] | None) -> tuple[nn.Module, np.ndarray, dict[str, Any]]:
    """The untrained network of ``cfg``, an input example and the input's description.

    Digits (inside scikit-learn's wheel) gives real validation samples; the others (cifar10, files,
    shards, synthetic) a batch of the right shape at the normalised mean, so that no export lists a
    data set, and none reads ``data.path``: ``models register`` exports from a run folder's config,
    which must not choose a file of the caller's to read.
    """
    from runtime.train.model_zoo import build_model

    d, m = cfg.data, cfg.model.model_copy(update={"channels_last": False, "sync_batchnorm": False,
                                                   "gradient_checkpointing": False})
    if m.name == "gpt":
        seq = m.transformer.seq_len
        example = np.zeros((EXAMPLE_ROWS, seq), dtype=np.int64)
        inputs = {"dtype": "int64", "shape": [-1, seq], "kind": "token ids", "vocab_size": m.transformer.vocab_size}
        return build_model(m, 0, 0, 0), example, inputs
    from runtime.data.builtin import CIFAR_CLASSES, CIFAR_MEAN, CIFAR_STD, build_builtin

    if d.source == "digits":
        bundle = build_builtin(d)
        x = normalised(torch.stack([bundle.val[i][0] for i in range(EXAMPLE_ROWS)]), bundle.mean, bundle.std)
        num_classes, channels, size, mean, std = (bundle.num_classes, bundle.in_channels, bundle.image_size,
                                                  bundle.mean, bundle.std)
    elif d.source == "cifar10":  # the data set's constants (runtime.data.builtin), not its files
        channels, size, num_classes, mean, std = 3, d.image_size, len(CIFAR_CLASSES), CIFAR_MEAN, CIFAR_STD
        x = torch.zeros(EXAMPLE_ROWS, channels, size, size)
    else:
        from runtime.data.images import IMAGENET_MEAN, IMAGENET_STD

        channels, size = 3, d.image_size
        num_classes = len(classes) if classes else d.num_classes
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if d.source != "synthetic" else (None, None)
        x = torch.zeros(EXAMPLE_ROWS, channels, size, size)
    inputs = {"dtype": "float32", "shape": [-1, channels, size, size], "layout": "NCHW",
              "normalisation": ({"scale": 1 / 255, "mean": list(mean), "std": list(std)} if mean and std
                                else "none: the model takes the data set's values as they are")}
    return build_model(m, num_classes, channels, size), x.numpy().astype(np.float32), inputs


def normalised(x: torch.Tensor, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> torch.Tensor:
    """Samples as the model takes them: float, and with mean/std (uint8 data) normalised as the
    training step does on the device (runtime.train.device_input)."""
    x = x.float()
    if mean is None or std is None:
        return x
    return (x - 255.0 * torch.tensor(mean).view(1, -1, 1, 1)) / (255.0 * torch.tensor(std).view(1, -1, 1, 1))


def save_mlflow_model(model: FinalModel, cfg: JobConfig, out: Path) -> Path:
    """Write ``model`` as an MLflow PyTorch model folder at ``out`` (signature from the example)."""
    import mlflow.pytorch
    from mlflow.models import infer_signature

    with torch.no_grad():
        output = model.module(torch.from_numpy(model.example)).numpy()
    signature = infer_signature(model.example, output)
    with tempfile.TemporaryDirectory() as d:
        config_file = Path(d) / "resolved_config.yaml"
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        common: dict[str, Any] = {"signature": signature, "input_example": model.example,
                                  "metadata": model.metadata, "extra_files": [str(config_file)],
                                  "pip_requirements": [f"torch=={torch.__version__.split('+')[0]}", "numpy"]}
        try:
            mlflow.pytorch.save_model(model.module, str(out), serialization_format="pt2", **common)
        except Exception as e:  # noqa: BLE001 (torch.export raises many kinds for graphs it cannot capture)
            log.warning("torch.export could not capture %s (%s); pickling it instead: loading it needs `runtime`",
                        cfg.model.name, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            _clear(out)
            mlflow.pytorch.save_model(model.module, str(out), **common)
    return out


def _clear(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def save_final_model(cfg: JobConfig, checkpoint_uri: str, out: Path) -> tuple[Path, int] | None:
    """The tracker's ModelExporter: the run's final model as an MLflow model folder at ``out`` and
    its step; None when the run has no valid checkpoint."""
    model = final_model(checkpoint_uri, cfg)
    if model is None:
        return None
    return save_mlflow_model(model, cfg, out), model.step
