"""A folder as an object store (``file://PATH``, the embedded default ``file://./berth-store``).

A key is a path under the folder. Writes go to a hidden temporary file beside the target
(``.<name>.<random>.berth-tmp``: no key names one, since ``check_key`` refuses parts that start with
a dot), are flushed to disk, and renamed into place with ``os.replace``: readers see the old file
or the new one, and a writer killed half-way leaves only a temporary file that ``list`` never
shows and ``sweep_temporaries`` deletes once it is old (the checkpoint collection calls it).
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError, check_key

TMP_SUFFIX = ".berth-tmp"
_OLD_TMP_SUFFIX = ".tmp"  # what berth named them before


def is_temporary(name: str) -> bool:
    """Whether a file name is one of the store's temporary files (a file's name, not a key)."""
    return name.startswith(".") and name.endswith((TMP_SUFFIX, _OLD_TMP_SUFFIX))


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        with self._errors(key, writing=True), self.writer(key) as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with self._errors(key):
            return self.path(key).read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._errors(key), open(self.path(key), "rb") as f:
            f.seek(start)
            return f.read(max(0, length))

    def open(self, key: str) -> BinaryIO:
        with self._errors(key):
            return open(self.path(key), "rb")

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        folder = self.root / prefix.rpartition("/")[0]
        found = []
        with self._errors(prefix):
            for dirpath, _, filenames in os.walk(folder):
                for name in filenames:
                    path = Path(dirpath, name)
                    key = path.relative_to(self.root).as_posix()
                    if key.startswith(prefix) and not name.startswith("."):
                        try:
                            st = path.stat()
                        except FileNotFoundError:  # deleted while listing
                            continue
                        found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return iter(sorted(found, key=lambda o: o.key))

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.path(key).unlink(missing_ok=True)

    def sweep_temporaries(self, older_than: float) -> int:
        """Delete the temporary files of writers killed half-way: those not written to for
        ``older_than`` seconds (a live writer's file is younger; one stalled longer than that
        fails on its rename with a ``StorageError``, it never stores a partial object). Returns
        how many were deleted."""
        cutoff = time.time() - older_than
        deleted = 0
        with self._errors(""):
            for dirpath, _, filenames in os.walk(self.root):
                for name in filenames:
                    if not is_temporary(name):
                        continue
                    path = Path(dirpath, name)
                    try:
                        if path.stat().st_mtime < cutoff:
                            path.unlink()
                            deleted += 1
                    except FileNotFoundError:  # renamed into place or deleted meanwhile
                        continue
        return deleted

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        target = self.path(key)
        with self._errors(key, writing=True):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                with self._errors(key, writing=True):
                    f.flush()
                    os.fsync(f.fileno())
            with self._errors(key, writing=True):
                os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)

    @contextmanager
    def _errors(self, key: str, writing: bool = False) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError as exc:
            if writing:
                raise StorageError(f"{self.url}: cannot write {key!r}: {exc.strerror or exc}") from exc
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
        except OSError as exc:
            raise StorageError(f"{self.url}: {key!r}: {exc.strerror or exc}") from exc
