"""Token sequences for model.name=gpt, kept on the device like the synthetic images.

- ``tokens``: synthetic text from a fixed random "grammar": every token has four possible
  successors, so a model can learn the data down to a loss of ln 4 ~ 1.39 nats per token.
- ``text``: real text every machine has, the bytes of Python's standard library sources
  (sorted by path, up to ``TEXT_BYTES``; deterministic for a given Python version), cut into
  non-overlapping windows; the last 5% of windows are held out for validation.

A sample is ``seq_len + 1`` tokens: the model reads the first ``seq_len`` and predicts each next one.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

from runtime.config import JobConfig
from runtime.data.base import DataBundle, Loaders, Stage
from runtime.data.order import check_epoch, epoch_unit
from runtime.data.synthetic import SyntheticLoader
from runtime.errors import ConfigError

TEXT_BYTES = 2 << 20
SUCCESSORS = 4


def stdlib_text(limit: int = TEXT_BYTES) -> bytes:
    """The standard library's .py sources (tests and site-packages left out), in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "test" in rel or "tests" in rel:
            continue
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _grammar_sequences(n: int, length: int, vocab: int, seed: int, split: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    table = torch.randint(vocab, (vocab, SUCCESSORS), generator=g, device=device)  # shared by every split
    g.manual_seed(seed * 1_000_003 + split + 1)
    seqs = torch.empty(n, length, dtype=torch.long, device=device)
    seqs[:, 0] = torch.randint(vocab, (n,), generator=g, device=device)
    choice = torch.randint(SUCCESSORS, (n, length), generator=g, device=device)
    for t in range(1, length):
        seqs[:, t] = table[seqs[:, t - 1], choice[:, t]]
    return seqs


class _Windows:
    """ids -> (inputs, next-token targets) from a token tensor on the device."""

    def __init__(self, seqs: torch.Tensor | None, text: torch.Tensor | None, seq_len: int, first: int) -> None:
        self.seqs, self.text, self.seq_len, self.first = seqs, text, seq_len, first
        self.offsets = torch.arange(seq_len + 1, device=(seqs if seqs is not None else text).device)  # type: ignore[union-attr]

    def stage(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids, _ = batch
        ids = ids.to(self.offsets.device, non_blocking=True)
        if self.seqs is not None:
            rows = self.seqs[ids % len(self.seqs)]
        else:
            assert self.text is not None
            rows = self.text[(ids + self.first)[:, None] * self.seq_len + self.offsets].long()
        return rows[:, :-1], rows[:, 1:]


def token_loaders(cfg: JobConfig, world: int, rank: int, device: torch.device) -> tuple[Loaders, Stage, Stage]:
    """Loaders over sample ids, and the train/val stages that cut sequences out on the device."""
    d, t = cfg.data, cfg.model.transformer
    if cfg.model.name != "gpt":
        raise ConfigError(f"data.source={d.source} makes token sequences: it needs model.name=gpt")
    if d.source == "tokens":
        n_train, n_val = d.num_samples, d.val_samples
        pool = min(n_train, max(2 * d.batch_size, (64 << 20) // (8 * (t.seq_len + 1))))
        train_w = _Windows(_grammar_sequences(pool, t.seq_len + 1, t.vocab_size, d.seed, 0, device), None, t.seq_len, 0)
        val_w = _Windows(_grammar_sequences(max(n_val, 1), t.seq_len + 1, t.vocab_size, d.seed, 1, device), None,
                         t.seq_len, 0)
    else:
        if t.vocab_size < 256:
            raise ConfigError(f"data.source=text makes byte tokens: model.transformer.vocab_size must be >= 256, "
                              f"got {t.vocab_size}")
        raw = stdlib_text()
        windows = (len(raw) - 1) // t.seq_len
        n_val = max(1, windows // 20)
        n_train = windows - n_val
        text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        train_w, val_w = _Windows(None, text, t.seq_len, 0), _Windows(None, text, t.seq_len, n_train)
    unit = epoch_unit(cfg)
    check_epoch(n_train, world, d.batch_size, unit, "sequences")
    pin = device.type == "cuda"
    train = SyntheticLoader(n_train, world, rank, d.batch_size, d.seed, True, pin, unit)
    val = SyntheticLoader(n_val, world, rank, d.batch_size, d.seed, False, pin) if n_val else None
    bundle = DataBundle(train, val, t.vocab_size, 0, t.seq_len)
    return Loaders(train, val, train.per_rank // d.batch_size, bundle), train_w.stage, val_w.stage
