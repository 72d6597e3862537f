"""What goes into a checkpoint besides parameters: RNG streams and a CPU snapshot.

Everything here produces plain containers of tensors and Python scalars, because
checkpoints are loaded with ``torch.load(weights_only=True)``, which refuses numpy
arrays and arbitrary classes.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (global), torch CPU and every CUDA device's generator state."""
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            # uint32 key held as int64: weights_only loading accepts tensors, not ndarrays.
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state; CUDA states are restored when both sides have CUDA."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
            "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint has RNG state for {len(cuda)} CUDA devices, "
                f"this process sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all(cuda)


def snapshot_to_cpu(obj: Any) -> Any:
    """Deep copy of nested dicts/lists/tuples with every tensor cloned to CPU.

    Runs on the training thread so the background writer never sees parameters that
    the next optimizer step is already changing.
    """
    if isinstance(obj, torch.Tensor):
        # .to("cpu") already copies a CUDA tensor; a CPU tensor needs an explicit clone.
        t = obj.detach()
        return (
            t.to("cpu").contiguous()
            if t.device.type != "cpu"
            else t.clone(memory_format=torch.contiguous_format)
        )
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, snapshot_to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: snapshot_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot_to_cpu(v) for v in obj)
    return copy.deepcopy(obj)
