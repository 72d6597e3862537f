"""Tune's search state is sealed by the driver: storage writers cannot make the driver unpickle their bytes.

Real pyarrow filesystems over real files; the Tune-level checks (a real search, a planted
tuner.pkl and experiment state) are in tests/integration/test_tune_state_resume.py.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.tune.sealed_state import (
    MAC_SUFFIX,
    SearchStateError,
    driver_key,
    inner_path,
    sealed_filesystem,
    verify_sealed,
)
from tests.support import ROOT


@pytest.fixture(autouse=True)
def key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "keys" / "tune_state.key"
    monkeypatch.setenv("RT_TUNE_STATE_KEY_FILE", str(path))
    return path


def _write(fs: object, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:  # type: ignore[attr-defined]
        f.write(data)


def _read(fs: object, path: str) -> bytes:
    with fs.open_input_stream(path) as f:  # type: ignore[attr-defined]
        return bytes(f.readall())


def test_state_files_written_through_the_driver_are_sealed_and_read_back(tmp_path: Path) -> None:
    search = tmp_path / "search"
    (search / "run_trial_1").mkdir(parents=True)
    fs = sealed_filesystem(str(tmp_path), str(search), None)
    _write(fs, f"{search}/tuner.pkl", b"state")
    _write(fs, f"{search}/run_trial_1/error.pkl", b"err")
    _write(fs, f"{search}/run_trial_1/progress.csv", b"a,b\n")  # not state: no seal
    (search / "report.csv").write_text("trial_id\n")  # the driver's report: not state
    assert (search / f"tuner.pkl{MAC_SUFFIX}").is_file()
    assert (search / "run_trial_1" / f"error.pkl{MAC_SUFFIX}").is_file()
    assert not (search / "run_trial_1" / f"progress.csv{MAC_SUFFIX}").exists()
    assert _read(fs, f"{search}/report.csv") == b"trial_id\n"
    assert _read(fs, f"{search}/tuner.pkl") == b"state"
    with fs.open_input_file(f"{search}/run_trial_1/error.pkl") as f:
        assert f.readall() == b"err"
    assert verify_sealed(fs) == 2


@pytest.mark.parametrize("planted", ["tuner.pkl", "experiment_state-2099-01-01_00-00-00.json",
                                     "run_trial_1/error.pkl", "searcher-state-x.pkl"])
def test_a_state_file_planted_by_a_storage_writer_is_refused_before_and_at_read(tmp_path: Path, planted: str) -> None:
    search = tmp_path / "search"
    (search / "run_trial_1").mkdir(parents=True)
    fs = sealed_filesystem(str(tmp_path), str(search), None)
    _write(fs, f"{search}/tuner.pkl", b"state")
    (search / planted).write_bytes(pickle.dumps(os.getcwd))  # no seal, or a seal of other bytes
    with pytest.raises(SearchStateError, match=planted.split("/")[-1]):
        verify_sealed(fs)
    with pytest.raises(SearchStateError, match="refusing to load it"):
        _read(fs, f"{search}/{planted}")


def test_a_seal_copied_onto_another_state_file_does_not_fit(tmp_path: Path) -> None:
    search = tmp_path / "search"
    search.mkdir()
    fs = sealed_filesystem(str(tmp_path), str(search), None)
    _write(fs, f"{search}/searcher-state-a.pkl", b"trusted")
    (search / "tuner.pkl").write_bytes(b"trusted")  # same bytes, under another name
    (search / f"tuner.pkl{MAC_SUFFIX}").write_bytes((search / f"searcher-state-a.pkl{MAC_SUFFIX}").read_bytes())
    with pytest.raises(SearchStateError, match="does not match its seal"):
        _read(fs, f"{search}/tuner.pkl")


def test_a_copy_of_the_filesystem_pickled_to_another_process_has_no_key_and_reads_no_state(tmp_path: Path) -> None:
    search = tmp_path / "search"
    search.mkdir()
    fs = sealed_filesystem(str(tmp_path), str(search), None)
    _write(fs, f"{search}/tuner.pkl", b"state")
    blob = tmp_path / "fs.pkl"
    blob.write_bytes(pickle.dumps(fs))
    assert driver_key() not in blob.read_bytes()
    assert _read(pickle.loads(blob.read_bytes()), f"{search}/tuner.pkl") == b"state"  # same process: a copy
    code = ("import pickle, sys; fs = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "try:\n    fs.open_input_stream(sys.argv[2]).readall()\nexcept Exception as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code, str(blob), f"{search}/tuner.pkl"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "without the driver's key" in out.stdout


def test_the_driver_key_is_made_private_and_refused_when_others_can_read_it(key_file: Path) -> None:
    key = driver_key()
    assert len(key) == 32 and driver_key() == key
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.parent.stat().st_mode & 0o777 == 0o700
    key_file.chmod(0o644)
    with pytest.raises(SearchStateError, match="readable by others"):
        driver_key()


@pytest.mark.parametrize(("given", "inside"), [
    ("gs://bucket/searches/s1", "bucket/searches/s1"), ("s3://bucket", "bucket"),
    ("az://container/p/", "container/p"), ("/srv/runs/s1/", "/srv/runs/s1"),
    ("bucket/searches/s1", "bucket/searches/s1"),
])
def test_tune_is_given_paths_inside_its_filesystem_never_an_object_stores_uri(given: str, inside: str) -> None:
    """pyarrow's object-store filesystems refuse a URI ("Expected a GCS object path of the form
    'bucket/key...'"): a search on gs:// failed at its first state read before Tune was given these."""
    assert inner_path(given) == inside


def test_a_search_on_gs_is_sealed_and_verified_on_the_store(tmp_path: Path) -> None:
    """A search on an object store (the GCS emulator): Tune writes its state through the filesystem the
    driver hands it, at paths inside that filesystem; the check before a resume lists the search folder
    the driver knows by its URI. That listing was given the URI and refused it (pyarrow: "Expected a GCS
    object path of the form 'bucket/key...'"), so no search on a store could resume."""
    from runtime.config.storage import parse_storage
    from tests.support import free_port
    from tests.support.object_stores import start_gcs_emulator, stop

    port = free_port()
    proc = start_gcs_emulator(port, "rt-state")
    try:
        storage = "gs://rt-state/searches"
        search = f"{storage}/s1"
        fs = sealed_filesystem(storage, search, parse_storage(storage).filesystem(f"http://127.0.0.1:{port}"))
        _write(fs, f"{inner_path(search)}/tuner.pkl", b"state")
        _write(fs, f"{inner_path(search)}/run_trial_1/error.pkl", b"err")
        assert _read(fs, f"{inner_path(search)}/tuner.pkl") == b"state"
        assert verify_sealed(fs) == 2
    finally:
        stop(proc)
