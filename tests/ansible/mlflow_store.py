"""The runtime venv's half of test_mlflow_artifact_store.py (the ops venv has Ansible, not moto,
boto3 or MLflow): an S3 server on loopback that checks IAM like AWS does, and the two clients of
the attack, a job holding the head's instance-role key and the store's owner.

    python tests/ansible/mlflow_store.py serve PORT KEYS_JSON     moto with IAM enforced
    python tests/ansible/mlflow_store.py job                      log an artifact through MLflow
    python tests/ansible/mlflow_store.py keys                     the keys under mlflow/
    python tests/ansible/mlflow_store.py s3 OP KEY                get/put/delete as AWS_* says
Every command prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

BUCKET = "artifacts"
# Users as Terraform makes them: the head's instance role (every job on the head can use it) keeps
# ray/ only; the artifact store's own user has mlflow/. Same statements as gpu_node_pool's policy.
PREFIXES = {"head-role": "ray/", "mlflow-artifacts": "mlflow/"}
PAYLOAD = b"team-a model weights v1"


def serve(port: str, keys_path: str) -> None:
    """moto on 127.0.0.1:port; every request after set-up is signed and checked against IAM."""
    from moto import settings
    from moto.iam.models import iam_backends
    from moto.s3.models import s3_backends
    from moto.server import main

    account = "123456789012"
    s3_backends[account]["aws"].create_bucket(BUCKET, "us-east-1")
    iam = iam_backends[account]["global"]
    keys = {}
    for user, prefix in PREFIXES.items():
        iam.create_user("us-east-1", user, path="/")
        policy = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": f"arn:aws:s3:::{BUCKET}/{prefix}*"},
            {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{BUCKET}",
             "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}*"]}}}]}
        iam.put_user_policy(user, "checkpoint-bucket", json.dumps(policy))
        key = iam.create_access_key(user)
        keys[user] = {"AWS_ACCESS_KEY_ID": key.access_key_id, "AWS_SECRET_ACCESS_KEY": key.secret_access_key}
    with open(keys_path + ".tmp", "w") as f:
        json.dump(keys, f)
    os.replace(keys_path + ".tmp", keys_path)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on, as AWS: unknown keys and foreign prefixes refused
    main(["-H", "127.0.0.1", "-p", port])


def stored_keys() -> list[str]:
    """Every key under mlflow/, listed with the credentials in the environment."""
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"], region_name="us-east-1")
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="mlflow/").get("Contents", [])]


def job() -> dict[str, object]:
    """What a job does with MLFLOW_TRACKING_URI: log the weights, read them back through the server."""
    import tempfile
    from pathlib import Path

    import mlflow

    client = mlflow.MlflowClient()
    exp = client.create_experiment("team-a")
    run = client.create_run(exp)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "weights.bin").write_bytes(PAYLOAD)
        client.log_artifact(run.info.run_id, str(Path(tmp) / "weights.bin"), artifact_path="model")
        back = Path(client.download_artifacts(run.info.run_id, "model/weights.bin", tmp)).read_bytes()
    return {"artifact_uri": client.get_run(run.info.run_id).info.artifact_uri, "read_back": back == PAYLOAD,
            "experiment_id": exp, "run_id": run.info.run_id}


def s3(op: str, key: str) -> dict[str, object]:
    """One S3 call with the credentials in the environment; the error code AWS would answer, or OK."""
    import boto3
    import botocore.exceptions

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"], region_name="us-east-1")
    try:
        if op == "get":
            return {"code": "OK", "body": client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()}
        if op == "put":
            client.put_object(Bucket=BUCKET, Key=key, Body=b"swapped by a job")
        elif op == "delete":
            client.delete_object(Bucket=BUCKET, Key=key)
        return {"code": "OK"}
    except botocore.exceptions.ClientError as e:
        return {"code": e.response["Error"]["Code"]}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "job":
        print(json.dumps(job()))
    elif sys.argv[1] == "keys":
        print(json.dumps(stored_keys()))
    else:
        print(json.dumps(s3(sys.argv[2], sys.argv[3])))
