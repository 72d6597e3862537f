"""Verified, asynchronous checkpoints on a local folder or an object store (S3, GCS, Azure Blob).

``CheckpointManager`` snapshots state on the training thread, writes it in one
background thread, commits with a manifest of sha256 hashes written last, and on
restore skips any folder that does not verify. Files load with ``weights_only=True``.
``CheckpointReader`` lists, verifies and loads without writing: read-only callers use it.
Under FSDP every rank writes its own shards (``save_sharded``, the ``sharded`` module) and
loads them resharded (``sharded_load``, which trusts no file it reads); both writers share the
format and commit protocol of the ``format`` module.
Backends: ``storage`` (the API and local folders), ``objects`` (the object-store commit protocol,
and any store with a pyarrow filesystem), ``s3`` (boto3); ``backends.open_storage`` picks one
for a location (``runtime.config.storage``).
"""

from runtime.checkpoint.backends import open_storage
from runtime.checkpoint.extra_state import capture_rng_state, restore_rng_state, snapshot_to_cpu
from runtime.checkpoint.format import CheckpointRef, step_name
from runtime.checkpoint.manager import CheckpointManager, CheckpointMetrics
from runtime.checkpoint.pointer import read_pointer
from runtime.checkpoint.reader import CheckpointReader
from runtime.checkpoint.s3 import S3Storage
from runtime.checkpoint.storage import CheckpointError, LocalStorage, Storage

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMetrics",
    "CheckpointReader",
    "CheckpointRef",
    "LocalStorage",
    "S3Storage",
    "Storage",
    "capture_rng_state",
    "open_storage",
    "read_pointer",
    "restore_rng_state",
    "snapshot_to_cpu",
    "step_name",
]
