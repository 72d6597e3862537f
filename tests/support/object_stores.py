"""Real GCS and Azure Blob emulators on loopback for the object-store checkpoint tests:
``gcp-storage-emulator`` (PyPI, in the runtime venv) and Microsoft's Azurite (npm, unpacked into
the tool folder by ``make azurite-tools``). Both keep objects in memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from runtime.config.storage.azure import ACCOUNT_ENV, KEY_ENV

ROOT = Path(__file__).resolve().parents[2]
AZURITE_VERSION = "3.37.0"  # as mk/azurite.mk installs it
AZURITE_BLOB = ROOT / ".tools" / f"azurite-{AZURITE_VERSION}" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (published in its README; accepted by Azurite only).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
# In the variables a node (or an operator's shell) names them in.
AZURITE_ENV = {ACCOUNT_ENV: AZURITE_ACCOUNT, KEY_ENV: AZURITE_KEY}


def _wait_listening(proc: subprocess.Popen[bytes], port: int, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} on port {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def start_gcs_emulator(port: int, bucket: str, timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """gcp-storage-emulator on 127.0.0.1:port, in memory, with ``bucket`` made before it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
         "--in-memory", "--default-bucket", bucket],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_listening(proc, port, "gcp-storage-emulator", timeout)
    return proc


def start_azurite(port: int, timeout: float = 90.0) -> subprocess.Popen[bytes]:
    """Azurite's blob service on 127.0.0.1:port, in memory (node takes ~15 s to start on 2 busy cores)."""
    if not AZURITE_BLOB.exists():
        raise RuntimeError(f"{AZURITE_BLOB} is missing: run `make azurite-tools`")
    proc = subprocess.Popen(
        [str(AZURITE_BLOB), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
         "--silent", "--skipApiVersionCheck", "--loose"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    _wait_listening(proc, port, "azurite", timeout)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the emulator (SIGKILL: a crash) and reap it."""
    proc.kill()
    proc.wait()
