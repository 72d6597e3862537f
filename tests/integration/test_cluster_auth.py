"""Every client authenticates to the local cluster through runtime.cluster.authenticate, whatever set
the token variables first and whenever Ray was imported.

The failure it closes: `make flow`'s train step imported Ray (through the driver) before the token
variables were set, set them itself, and then the driver's connect found them set and skipped the
reload of Ray's cached auth settings: InvalidAuthToken from the GCS, then a ConnectionError. Here a
fresh process primes Ray's cache with no token, sets the variables as that step did, and connects.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow

CLIENT = """
import sys
import ray
from ray._raylet import AuthenticationTokenLoader

assert not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)  # Ray's cache: no token
from runtime.cluster import ray_address, use_cluster_auth

assert use_cluster_auth()  # the token variables set after Ray read them, as the flow's train step did
if sys.argv[1] == "connect":
    from runtime.launch.driver import connect

    connect()
else:  # the bare ray.init that the cached settings break: the control that the cache was primed
    ray.init(address=ray_address(), log_to_driver=False)

@ray.remote(num_cpus=0)
def node() -> str:
    return ray.get_runtime_context().get_node_id()

print("ran on", ray.get(node.remote()), flush=True)
"""


def _client(how: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    # HOME: no ~/.ray/auth_token of the machine's user can stand in for the cluster's token.
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    return subprocess.run([sys.executable, "-c", CLIENT, how], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_connect_authenticates_after_ray_cached_no_token_and_the_variables_were_set_by_someone_else(
        cluster: dict[str, Any], tmp_path: Path) -> None:
    done = _client("connect", tmp_path)
    assert done.returncode == 0 and "ran on" in done.stdout, (done.stdout + done.stderr)[-3000:]

    bare = _client("bare", tmp_path)  # without the refresh the same process is refused
    assert bare.returncode != 0 and "ran on" not in bare.stdout, (bare.stdout + bare.stderr)[-3000:]
