"""Settings that cannot work together, nesting PyYAML cannot read, and environment overrides of unknown
fields: each refused with exit 2, naming the fields (or the file and line, or the variable), before Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.cli import main


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return out.out + out.err


@pytest.mark.parametrize(("sets", "expect"), [
    (["distributed.strategy=fsdp", "train.update_mode=local_sgd"],
     ["train.update_mode=local_sgd", "distributed.strategy=fsdp"]),
    (["optimizer.name=adam", "optimizer.betas=[0.9, 1.0]"], ["optimizer.betas", "[0, 1)"]),
    (["optimizer.betas=[-0.1, 0.999]"], ["optimizer.betas"]),
    (["optimizer.name=sgd", "optimizer.nesterov=true", "optimizer.momentum=0"],
     ["optimizer.nesterov", "optimizer.momentum"]),
    (["train.max_steps=30", "checkpoint.at_steps=[10, 40]"], ["checkpoint.at_steps", "[40]", "train.max_steps=30"]),
    (["train.max_steps=30", "train.eval_at_steps=[31]"], ["train.eval_at_steps", "[31]", "train.max_steps=30"]),
])
def test_settings_that_cannot_work_together_are_refused_naming_both_fields(
        capsys: pytest.CaptureFixture[str], sets: list[str], expect: list[str]) -> None:
    out = _refused(capsys, ["validate", "digits_smoke", *[a for s in sets for a in ("--set", s)]])
    assert all(e in out for e in expect), out


def test_steps_within_the_run_and_nesterov_under_adam_stay_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "digits_smoke", "--set", "train.max_steps=30", "--set", "checkpoint.at_steps=[30]",
                 "--set", "optimizer.name=adamw", "--set", "optimizer.nesterov=true"]) == 0


def test_a_job_file_nested_thousands_deep_is_refused_with_its_line_not_a_recursion_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "deep.yaml"
    job.write_text("name: deep\ndescription: " + "[" * 5000 + "]" * 5000 + "\n")
    out = _refused(capsys, ["validate", str(job)])
    assert f"{job}:2: nested more than 64 levels deep" in out
    deep = "[" * 2000 + "]" * 2000
    assert "nested more than 64 levels" in _refused(capsys, ["validate", "digits_smoke", "--set", f"data.x={deep}"])


def test_an_environment_override_of_an_unknown_section_names_its_variable(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RT_FOO__BAR", "1")
    out = _refused(capsys, ["validate", "digits_smoke"])
    assert "foo: unknown field" in out and "[from RT_FOO__BAR]" in out
