"""Object stores: a local folder (``file://PATH``) or S3 (``s3://BUCKET/PREFIX``).

    store = open_store(settings.storage_url)
    store.put("checkpoints/v1/state/42.json", data)
"""

from __future__ import annotations

from storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError, check_key

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "StorageError", "check_key", "open_store"]


def open_store(url: str) -> ObjectStore:
    """The store a URL names; ``ValueError`` saying what to write for anything else."""
    if url.startswith("file://"):
        from storage.local import LocalStore

        return LocalStore(url.removeprefix("file://"))
    if url.startswith("s3://"):
        from storage.s3 import S3Store

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3Store(bucket, prefix)
    raise ValueError(f"storage URL {url!r}: give file:///path/to/folder or s3://bucket/prefix")
