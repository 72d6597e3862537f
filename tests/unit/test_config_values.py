"""The one parser per kind of typed value (runtime.config.values): what each accepts, returns and
refuses, and that the storage location answers "remote?" by its class, not by string prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.storage import AzureLocation, GcsLocation
from runtime.config.values import (
    SCHEMES,
    SEED_MAX,
    LocalLocation,
    S3Location,
    parse_http_url,
    parse_mlflow_uri,
    parse_port,
    parse_seed,
    parse_storage,
)


def test_storage_locations_parse_to_a_class_per_scheme_that_says_whether_it_is_remote() -> None:
    s3 = parse_storage("s3://my-bucket/runs/a/")
    assert isinstance(s3, S3Location) and s3.remote and (s3.bucket, s3.prefix) == ("my-bucket", "runs/a")
    local = parse_storage("~/runs")
    assert isinstance(local, LocalLocation) and not local.remote and local.path == Path.home() / "runs"
    gcs, az = parse_storage("gs://my_bucket/runs"), parse_storage("az://runs-1/a")
    assert isinstance(gcs, GcsLocation) and gcs.remote and gcs.join("r", "checkpoints") == "gs://my_bucket/runs/r/checkpoints"
    assert isinstance(az, AzureLocation) and (az.bucket, az.fs_path) == ("runs-1", "runs-1/a")
    assert set(SCHEMES) == {"s3", "gs", "az"}  # a new backend registers here; nothing else parses schemes


@pytest.mark.parametrize(("text", "message"), [
    ("s3:/bucket/x", "did you mean 's3://bucket/x'"),
    ("s3:bucket", "did you mean 's3://bucket'"),
    ("S3://bucket", "lowercase"),
    ("hdfs://bucket/x", "hdfs:// is not a storage"),
    ("gs://Bucket", "lowercase letters"),
    ("gs:/bucket", "did you mean 'gs://bucket'"),
    ("az://", "needs a container name"),
    ("az://a--b", "single '-'"),
    ("file:///srv/runs", "file:// is not a storage"),
    ("http://host/x", "must be a local folder or s3://bucket/prefix"),
    ("s3://", "needs a bucket name"),
    ("s3://Bad_Bucket", "lowercase letters"),
    ("", "is empty"),
    ("runs\x00x", "control characters"),
])
def test_storage_text_that_is_neither_a_folder_nor_a_known_url_is_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_storage(text)


def test_a_local_location_over_a_regular_file_is_refused_but_a_new_folder_is_fine(tmp_path: Path) -> None:
    (tmp_path / "model.pt").write_text("x")
    parse_storage(str(tmp_path / "new" / "runs")).check()  # created at the run's first write
    with pytest.raises(ValueError, match="the path is a file"):
        parse_storage(str(tmp_path / "model.pt")).check()
    with pytest.raises(ValueError, match="lies under .*model.pt"):
        parse_storage(str(tmp_path / "model.pt" / "runs")).check()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="broken link"):
        parse_storage(str(tmp_path / "dangling")).check()


@pytest.mark.parametrize("url", ["http://127.0.0.1:9000", "https://s3.us-east-1.amazonaws.com", "http://[::1]:80/x"])
def test_http_urls_with_a_host_and_a_real_port_pass_unchanged(url: str) -> None:
    assert parse_http_url(url) == url


@pytest.mark.parametrize(("url", "message"), [
    ("localhost:9000", "did you mean http://localhost:9000"),
    ("minio.local:9000/path", "did you mean http://minio.local:9000/path"),
    ("ftp://host", "http:// or https://"),
    ("http:/host", "http://host"),
    ("http://", "http://host"),
    ("http://h:99999", "port from 1 to 65535"),
    ("http://h:0", "port 0"),
    ("http://h:x", "port from 1 to 65535"),
    ("http://[::1", "valid URL"),
    (" http://h", "without spaces"),
])
def test_bad_http_urls_say_what_was_expected(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("/", "/")):
        parse_http_url(url)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "file:///srv/mlruns", "sqlite:///mlflow.db",
                                 "postgresql+psycopg2://u@db/mlflow", "databricks", "mlruns", "/srv/mlruns"])
def test_mlflow_tracking_uris_mlflow_accepts_pass(uri: str) -> None:
    assert parse_mlflow_uri(uri) == uri


@pytest.mark.parametrize("uri", ["htp:/x", "http:/x", "sqlite:/m.db", "s3://bucket/mlruns", "file:"])
def test_mlflow_uris_with_a_typo_in_the_scheme_are_refused(uri: str) -> None:
    with pytest.raises(ValueError):
        parse_mlflow_uri(uri)


def test_ports_and_seeds_are_bounded_and_booleans_are_not_numbers() -> None:
    assert parse_port("8080") == 8080 and parse_port(0, allow_zero=True) == 0
    for bad in (0, 65536, -1, "80x", "", True, 1.5, "٣"):  # the last: an Arabic-Indic digit isdigit() accepts
        with pytest.raises(ValueError, match="port number"):
            parse_port(bad)
    assert parse_seed(0) == 0 and parse_seed(SEED_MAX) == SEED_MAX
    for bad in (-1, SEED_MAX + 1, 10**30):
        with pytest.raises(ValueError, match="seed between 0 and"):
            parse_seed(bad)


def test_each_location_says_what_ray_persists_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ray gets the URI where it can open the store itself, else the path inside the store's filesystem."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert parse_storage(str(tmp_path)).ray_storage() == (str(tmp_path.resolve()), None)
    assert parse_storage("s3://b-1/runs/").ray_storage() == ("s3://b-1/runs", None)
    path, fs = parse_storage("s3://b-1/runs").ray_storage("http://127.0.0.1:9000")
    assert (path, fs.type_name) == ("b-1/runs", "s3")
    path, fs = parse_storage("gs://b-1/runs").ray_storage("http://127.0.0.1:9023")
    assert (path, fs.type_name) == ("b-1/runs", "gcs")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    path, fs = parse_storage("az://c-1").ray_storage("http://127.0.0.1:10000")
    assert (path, fs.type_name) == ("c-1", "abfs")


def test_an_azure_location_without_its_account_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(ValueError, match="set AZURE_STORAGE_ACCOUNT_NAME"):
        parse_storage("az://c-1/runs").check()


def test_an_azure_filesystem_travels_without_the_key_and_opens_with_the_receiving_processs_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray pickles the driver's RunConfig filesystem (cloudpickle) to its controller and workers: the
    driver's key must not go with it, and the process that loads it opens the store with its own
    environment (a node's), the job's endpoint kept."""
    import cloudpickle
    import pyarrow.fs

    monkeypatch.delenv("AZURE_STORAGE_ENDPOINT", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "driveracct")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "driver-key-sentinel")
    _, fs = parse_storage("az://c-1/runs").ray_storage("http://127.0.0.1:10000")
    sent = cloudpickle.dumps(fs)
    assert b"driver-key-sentinel" not in sent and b"driveracct" not in sent
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "nodeacct")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "node-key")
    loaded = cloudpickle.loads(sent)
    options = pyarrow.fs.AzureFileSystem.__reduce__(loaded)[1][0]  # pyarrow's own view of its options
    assert (options["account_name"], options["account_key"]) == ("nodeacct", "node-key")
    assert options["blob_storage_authority"] == "127.0.0.1:10000" and options["blob_storage_scheme"] == "http"
    assert isinstance(loaded, pyarrow.fs.AzureFileSystem) and loaded.type_name == "abfs"
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME")
    with pytest.raises(ValueError, match="set AZURE_STORAGE_ACCOUNT_NAME"):  # a node without the account
        cloudpickle.loads(sent)


def test_no_module_outside_the_storage_package_reads_a_scheme_off_a_url() -> None:
    """"Remote?", "which store?" are asked of the location type: a ``startswith("s3://")`` or a
    ``removeprefix("gs://")`` elsewhere would leave a new scheme half supported."""
    import ast

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "runtime").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("runtime/config/storage/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("startswith", "removeprefix") and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.rstrip("/").endswith(":") and node.args[0].value[:-3] in SCHEMES):
                found.append(f"{rel}:{node.lineno}")
            name = node.name if isinstance(node, ast.FunctionDef) else node.id if isinstance(node, ast.Name) else ""
            if name == "is_s3":
                found.append(f"{rel}:{node.lineno} is_s3")
    assert not found, "scheme tests outside runtime.config.storage:\n" + "\n".join(found)
