"""distributed.tp_size: every setting the 2-D mesh cannot be built from is refused by ``validate``
with exit 2 and one line naming both fields, before Ray; the settings it can be built from pass."""

from __future__ import annotations

import pytest

from runtime.cli import main
from runtime.config import load_job


def _refused(capsys: pytest.CaptureFixture[str], sets: list[str]) -> str:
    assert main(["validate", "gpt_small", *[a for s in sets for a in ("--set", s)]]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert len(text.strip().splitlines()) == 1, text
    return text


@pytest.mark.parametrize(("sets", "expect"), [
    (["distributed.strategy=ddp", "distributed.tp_size=2"], ["distributed.tp_size=2", "distributed.strategy=fsdp",
                                                              "got ddp"]),
    (["distributed.num_workers=4", "distributed.tp_size=3"], ["distributed.tp_size=3",
                                                              "distributed.num_workers=4"]),
    (["distributed.num_workers=4", "distributed.tp_size=8"], ["distributed.tp_size=8",
                                                              "distributed.num_workers=4"]),
    (["distributed.num_workers=6", "distributed.tp_size=6"], ["model.transformer.heads=4",
                                                              "distributed.tp_size=6"]),
    (["distributed.num_workers=4", "distributed.tp_size=2", "model.transformer.seq_len=127"],
     ["model.transformer.seq_len=127", "distributed.tp_size=2"]),
    (["distributed.num_workers={min: 2, max: 6}", "distributed.tp_size=4"],
     ["min: 2, max: 6", "distributed.tp_size=4"]),
    (["distributed.num_workers={min: 3, max: 4}", "distributed.tp_size=2"],
     ["min: 3, max: 4", "distributed.tp_size=2"]),
    (["distributed.tp_size=0"], ["distributed.tp_size"]),
])
def test_a_mesh_that_cannot_be_built_is_refused_in_one_line_naming_both_fields(
        capsys: pytest.CaptureFixture[str], sets: list[str], expect: list[str]) -> None:
    out = _refused(capsys, sets)
    assert all(e in out for e in expect), out


def test_tensor_parallelism_of_a_model_without_heads_is_refused_naming_the_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "digits_smoke", "--set", "distributed.strategy=fsdp", "--set",
                 "distributed.num_workers=2", "--set", "distributed.tp_size=2"]) == 2
    out = capsys.readouterr()
    assert "distributed.tp_size=2" in out.out + out.err and "model.name=gpt" in out.out + out.err


@pytest.mark.parametrize("sets", [
    ["distributed.num_workers=4", "distributed.tp_size=2"],
    ["distributed.num_workers=4", "distributed.tp_size=4"],
    ["distributed.num_workers={min: 2, max: 8}", "distributed.tp_size=2", "train.grad_accum_steps=3"],
])
def test_a_mesh_whose_sizes_divide_is_accepted(capsys: pytest.CaptureFixture[str], sets: list[str]) -> None:
    assert main(["validate", "gpt_small", *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr()


def test_an_elastic_tp_run_checks_its_global_batch_only_at_whole_groups(capsys: pytest.CaptureFixture[str]) -> None:
    # keep=global_batch holds 8 x 16 x 1 = 128 samples: whole per-worker batches at 4 and 8 workers
    # (the sizes whole groups of 4 make), not at 5, 6 or 7, which only a plain FSDP run may take.
    grows = ["distributed.num_workers={min: 4, max: 8}"]
    cfg = load_job("gpt_small", [*grows, "distributed.tp_size=4"], environ={})
    assert list(cfg.distributed.sizes()) == [4, 8]
    out = _refused(capsys, grows)
    assert "at 5, 6, 7 worker(s)" in out, out
