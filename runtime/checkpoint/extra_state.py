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


class SnapshotBuffers:
    """CPU destination tensors reused from one snapshot to the next.

    Copying a 190 MB state into freshly allocated memory is dominated by page faults and
    the kernel zeroing new pages (measured ~5x slower than copying into memory touched
    before), and that copy is the training stall of an async save. The price is one
    resident copy of the state in host memory between saves. The caller must not take a
    new snapshot while the previous one is still being written (the manager drains first).
    Buffers are matched by visiting order (a state's structure is the same from step to
    step; a tensor whose shape, strides or dtype changed gets a new one), which keeps the
    per-tensor bookkeeping to a list index. CUDA tensors land in pinned buffers with
    asynchronous copies, synchronised once.
    """

    def __init__(self) -> None:
        self._bufs: list[tuple[tuple[Any, ...], torch.Tensor]] = []  # (source layout, buffer)
        self._next = 0
        self._cuda = False

    def snapshot(self, obj: Any) -> Any:
        """Deep copy of nested dicts/lists/tuples with every tensor copied to CPU.

        Runs on the training thread so the background writer never sees parameters that
        the next optimizer step is already changing.
        """
        self._next, self._cuda = 0, False
        out = self._copy(obj)
        del self._bufs[self._next:]  # the state shrank: release what it no longer holds
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        i = self._next
        self._next += 1
        layout = (t.shape, t.stride(), t.dtype)
        if i < len(self._bufs) and self._bufs[i][0] == layout:
            return self._bufs[i][1]
        # empty_like keeps dense strides (channels_last stays a plain memcpy).
        buf = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        if i < len(self._bufs):
            self._bufs[i] = (layout, buf)
        else:
            self._bufs.append((layout, buf))
        return buf

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if type(t) is not torch.Tensor or t.layout != torch.strided:
                # Subclasses (DTensor) and sparse tensors: a one-off copy, no reuse.
                return t.to("cpu").contiguous() if t.device.type != "cpu" else t.clone()
            buf = self._buffer_for(t)
            buf.copy_(t, non_blocking=t.is_cuda)
            self._cuda = self._cuda or t.is_cuda
            return buf
        if isinstance(obj, (int, float, str, bool, type(None))):
            return obj  # immutable: nothing to copy
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, self._copy(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)


def snapshot_to_cpu(obj: Any) -> Any:
    """A one-off CPU snapshot (fresh buffers): see ``SnapshotBuffers`` for repeated saves."""
    return SnapshotBuffers().snapshot(obj)
