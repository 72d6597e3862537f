"""Driver-side progress: a bar on a terminal, plain log lines otherwise (CI, files)."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Shows step, loss, samples/s and ETA from the reports rank 0 sends."""

    def __init__(self, total: int | None, enabled: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar: Any = None
        self.total = total
        self.t0 = time.time()

    def _line(self, m: dict[str, Any]) -> str:
        parts = [f"step {m.get('step')}/{m.get('total_steps', '?')}"]
        for key, label, fmt in (("train/loss", "loss", ".4f"), ("train/accuracy", "acc", ".3f"),
                                ("train/throughput", "samples/s", ".1f"), ("val/accuracy", "val_acc", ".3f")):
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{label} {m[key]:{fmt}}")
        eta = self._eta(m)
        if eta is not None:
            parts.append(f"ETA {eta:.0f}s")
        return "  ".join(parts)

    def _eta(self, m: dict[str, Any]) -> float | None:
        step, total = m.get("step"), m.get("total_steps")
        if not step or not total:
            return None
        elapsed = time.time() - self.t0
        return elapsed / step * max(0, total - step)

    def update(self, m: dict[str, Any]) -> None:
        if not self.enabled or "step" not in m:
            return
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=m.get("total_steps"), file=self.stream, unit="step", dynamic_ncols=True)
            self.bar.n = m["step"]
            self.bar.set_postfix_str(self._line(m).split("  ", 1)[-1], refresh=True)
        else:
            print(f"[runtime] {self._line(m)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
