"""``validate --gpu-memory-gb G``: the per-GPU budget of runtime.parallelism.memory checked before
any GPU is asked for; a job over what G leaves usable exits 7 with one line naming both."""

from __future__ import annotations

import pytest

from runtime.cli import EXIT_BAD_INPUT, EXIT_NO_FIT, main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["validate", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out, "\n".join(line for line in out.err.splitlines() if not line.startswith("warning:"))


def test_gpt_10b_on_8_nodes_of_8_gpus_fits_an_80_gb_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "gpt_10b", "--gpu-memory-gb", "80")
    assert code == 0
    assert "gpt_10b: fits: 14.4 GB per GPU" in out and "dp=8 x tp=8 on a 80 GB GPU" in out, out


def test_a_gpu_too_small_for_the_budget_exits_7_naming_the_budget_and_the_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "gpt_10b", "--gpu-memory-gb", "12")
    assert code == EXIT_NO_FIT == 7
    assert err.startswith("error: gpt_10b: needs 14.4 GB per GPU, over the 10.8 GB usable of a 12 GB GPU"), err
    assert len(err.splitlines()) == 1


def test_gpt_10b_without_tensor_parallelism_is_refused_naming_its_activations(
        capsys: pytest.CaptureFixture[str]) -> None:
    # The same 64 GPUs as plain FSDP: each GPU computes a whole 4 x 4096-token micro-batch.
    code, _, err = _run(capsys, "gpt_10b", "--gpu-memory-gb", "80", "--set", "distributed.tp_size=1")
    assert code == EXIT_NO_FIT
    assert "needs 96.4 GB per GPU" in err and "largest: activations 91.3 GB" in err, err


def test_checkpointing_brings_plain_fsdp_back_under_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "gpt_10b", "--gpu-memory-gb", "80", "--set", "distributed.tp_size=1",
                        "--set", "model.gradient_checkpointing=true")
    assert code == 0, out


@pytest.mark.parametrize(("value", "expect"), [
    ("eighty", "--gpu-memory-gb: expected a number of GB, e.g. 80, got 'eighty'"),
    ("0", "--gpu-memory-gb: expected GB in (0, 100000], got 0"),
])
def test_a_gpu_size_that_is_not_a_size_is_refused_in_one_line(capsys: pytest.CaptureFixture[str], value: str,
                                                              expect: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["validate", "gpt_10b", "--gpu-memory-gb", value])
    assert exited.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err, err


def test_a_memory_check_of_a_model_without_a_budget_is_refused_naming_the_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "digits_smoke", "--gpu-memory-gb", "80")
    assert code == EXIT_BAD_INPUT
    assert "--gpu-memory-gb: the memory budget is worked out for model.name=gpt (got small_cnn)" in err, err
