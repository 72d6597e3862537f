"""The one place that imports torchvision.

torchvision's PyPI wheel links its compiled ops against the CUDA build of torch.
With the CPU wheel those ops (``torchvision::nms``...) do not exist, and
``import torchvision`` dies while registering their fake (meta) kernels. The
models we use are pure Python, so we tolerate exactly that failure: during the
import, fake-kernel registration for a missing ``torchvision::`` operator is a
no-op. Where the ops exist (GPU nodes, matching wheels) this changes nothing.
Never use ``torchvision.ops`` or ``torchvision.io`` from code tested here.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch


def _op_exists(qualname: str) -> bool:
    namespace, _, name = qualname.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name.split(".")[0])
    except (AttributeError, RuntimeError):
        return False
    return True


@contextlib.contextmanager
def _tolerate_missing_torchvision_ops() -> Iterator[None]:
    original = torch.library.register_fake

    def register_fake(op: Any, fn: Callable[..., Any] | None = None, /, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.startswith("torchvision::") and not _op_exists(op):
            return fn if fn is not None else (lambda f: f)
        return original(op, fn, **kwargs) if fn is not None else original(op, **kwargs)

    torch.library.register_fake = register_fake  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.library.register_fake = original


def import_torchvision() -> ModuleType:
    """Return the torchvision module, importable on CPU-only torch builds."""
    if "torchvision.models" in sys.modules:
        return sys.modules["torchvision"]
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        with _tolerate_missing_torchvision_ops():
            import torchvision
    import torchvision.models  # noqa: F401  (pure-Python model zoo)

    return torchvision
