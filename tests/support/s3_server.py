"""An S3 server for the tests: moto's, started in this process on a free port of 127.0.0.1, and a
fresh bucket per test."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint():
    """The URL of a moto S3 server; AWS_* variables pointing at it while the session runs."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint) -> str:
    """``s3://BUCKET/PREFIX`` of a bucket made for this test."""
    import boto3

    bucket = f"berth-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/deployment-a"
