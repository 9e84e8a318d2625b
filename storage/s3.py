"""S3 (or any S3-compatible store: MinIO, Ceph) as an object store: ``s3://BUCKET/PREFIX``.

Credentials and region come from the usual AWS variables and files; ``AWS_ENDPOINT_URL`` points it
elsewhere than AWS. botocore retries throttling and transient errors with exponential backoff.
Small objects go in one PUT, which S3 makes visible whole or not at all; streams (``open``,
``writer``) go through a temporary file and boto3's transfer manager, in parallel parts above
``MULTIPART_THRESHOLD`` (the object appears only when the last part is committed).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError, check_key

MULTIPART_THRESHOLD = 64 << 20  # files larger than this are uploaded in parts, in parallel
MULTIPART_CHUNK = 16 << 20
# No SHA-256 of every payload for the request signature (botocore's default over plain http: on a
# worker writing checkpoints it costs CPU the engine needs); the CRC32 checksum sent with each PUT
# still guards the bytes, as botocore does by default over https.
CLIENT_CONFIG = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60,
                       s3={"payload_signing_enabled": False})
_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str = "", client=None, transfer: TransferConfig | None = None):
        if not bucket:
            raise ValueError("an S3 storage URL needs a bucket: s3://BUCKET/PREFIX")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.client = client or boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None,
                                             config=CLIENT_CONFIG)
        self.transfer = transfer or TransferConfig(multipart_threshold=MULTIPART_THRESHOLD,
                                                   multipart_chunksize=MULTIPART_CHUNK)

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._name(key), Body=data)

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        with tempfile.TemporaryFile() as f:
            yield f
            f.seek(0)
            with self._errors(key):
                self.client.upload_fileobj(f, self.bucket, self._name(key), Config=self.transfer)

    def get(self, key: str) -> bytes:
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._name(key))["Body"].read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._name(key),
                                          Range=f"bytes={start}-{start + length - 1}")["Body"].read()

    def open(self, key: str) -> BinaryIO:
        f = tempfile.TemporaryFile()
        try:
            with self._errors(key):
                self.client.download_fileobj(self.bucket, self._name(key), f, Config=self.transfer)
        except BaseException:
            f.close()
            raise
        f.seek(0)
        return f

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self.client.head_object(Bucket=self.bucket, Key=self._name(key))
            return True
        except ObjectNotFound:
            return False

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        with self._errors(prefix):
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix):], obj["Size"], obj["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._name(key))

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in _MISSING:
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            if code == "NoSuchBucket":
                raise StorageError(f"{self.url}: the bucket {self.bucket!r} does not exist; create it, or fix "
                                   "BERTH_STORAGE_URL") from exc
            raise StorageError(f"{self.url}: {key!r}: {exc}") from exc
        except (BotoCoreError, Boto3Error) as exc:  # unreachable, no credentials, timeouts after the retries
            raise StorageError(f"{self.url}: {key!r}: {exc}") from exc
