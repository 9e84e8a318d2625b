"""A folder as an object store (``file://PATH``, the embedded default ``file://./berth-store``).

A key is a path under the folder. Writes go to a hidden temporary file beside the target
(``.<name>.<random>.berth-tmp``: no key names one, since ``check_key`` refuses parts that start with
a dot), are flushed to disk, and renamed into place with ``os.replace``: readers see the old file
or the new one, and a writer killed half-way leaves only a temporary file that ``list`` never
shows and ``sweep_temporaries`` deletes once it is old (the checkpoint collection calls it).

No link is followed below the root. A store is read on a tenant's behalf (a submit message names
an input in one; a file's content is served from the job store), and whoever can write into the
folder, a tenant dropping its inputs there included, could otherwise plant
``inbox/team-b/x.jsonl -> /etc/passwd`` (or ``-> ../team-a/secret.jsonl``, which a check that the
resolved path stays under the root would let through). So every operation walks the key's folders
one at a time from a descriptor of the root, each opened with ``O_NOFOLLOW | O_DIRECTORY``, and
opens the object itself with ``O_NOFOLLOW`` relative to its folder's descriptor: a symbolic link
anywhere below the root is refused, and nothing can swap one in between a check and the open
(there is no check apart from the open). Only regular files are objects: a FIFO, which would block
the reader forever, or a device is refused too. berth itself never makes links in a store. The
root is resolved once, when the store is opened: it is the operator's path, links and all.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

from storage.base import ObjectInfo, ObjectNotFound, ObjectStore, StorageError, check_key

TMP_SUFFIX = ".berth-tmp"
_OLD_TMP_SUFFIX = ".tmp"  # what berth named them before
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC  # NONBLOCK: a FIFO opens at once, and is refused
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC


class LinkRefused(StorageError):
    """A symbolic link (or anything but a folder or a regular file) where a key leads."""


def is_temporary(name: str) -> bool:
    """Whether a file name is one of the store's temporary files (a file's name, not a key)."""
    return name.startswith(".") and name.endswith((TMP_SUFFIX, _OLD_TMP_SUFFIX))


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"

    def path(self, key: str) -> Path:
        """Where the object of ``key`` is on disk (for tests and tools; the store reads through ``_folder``)."""
        return self.root / check_key(key)

    # ---- reads
    def get(self, key: str) -> bytes:
        with self.open(key) as f, self._errors(key):
            return f.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self.open(key) as f, self._errors(key):
            f.seek(start)
            return f.read(max(0, length))

    def open(self, key: str) -> BinaryIO:
        with self._errors(key), self._folder(key) as (folder, name):
            fd = os.open(name, _READ, dir_fd=folder)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise LinkRefused(f"{self.url}: {key!r} is not a regular file; a store reads only files")
                os.set_blocking(fd, True)
                return os.fdopen(fd, "rb")
            except BaseException:
                os.close(fd)
                raise

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key), self._folder(key) as (folder, name):
                return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
        except (ObjectNotFound, StorageError):
            return False

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """The regular files whose key starts with ``prefix``; a link is not listed, nor what it points to."""
        base = prefix.rpartition("/")[0]
        found = []
        try:
            with self._errors(prefix), self._folders(base.split("/") if base else [], prefix) as top:
                for dirpath, _, filenames, dirfd in os.fwalk(".", dir_fd=top):  # never into a link
                    for name in filenames:
                        key = os.path.normpath(os.path.join(base, dirpath, name))
                        if not key.startswith(prefix) or name.startswith("."):
                            continue
                        try:
                            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                        except FileNotFoundError:  # deleted while listing
                            continue
                        if stat.S_ISREG(st.st_mode):
                            found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        except ObjectNotFound:  # no such folder: nothing under it
            return iter(())
        return iter(sorted(found, key=lambda o: o.key))

    # ---- writes
    def put(self, key: str, data: bytes) -> None:
        with self._errors(key, writing=True), self.writer(key) as f:
            f.write(data)

    def delete(self, key: str) -> None:
        try:
            with self._errors(key), self._folder(key) as (folder, name):
                os.unlink(name, dir_fd=folder)  # a link itself, never what it points to
        except ObjectNotFound:
            pass

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        with ExitStack() as stack:
            with self._errors(key, writing=True):
                folder, name = stack.enter_context(self._folder(key, create=True))
                tmp = f".{name}.{secrets.token_hex(6)}{TMP_SUFFIX}"
                fd = os.open(tmp, _CREATE, 0o600, dir_fd=folder)
            stack.callback(_unlink_if_there, tmp, folder)  # after a failure, or a rename that did not happen
            with os.fdopen(fd, "wb") as f:
                yield f
                with self._errors(key, writing=True):
                    f.flush()
                    os.fsync(f.fileno())
            with self._errors(key, writing=True):
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)

    def sweep_temporaries(self, older_than: float) -> int:
        """Delete the temporary files of writers killed half-way: those not written to for
        ``older_than`` seconds (a live writer's file is younger; one stalled longer than that
        fails on its rename with a ``StorageError``, it never stores a partial object). Returns
        how many were deleted."""
        cutoff = time.time() - older_than
        deleted = 0
        with self._errors(""):
            for _, _, filenames, dirfd in os.fwalk(self.root):
                for name in filenames:
                    if not is_temporary(name):
                        continue
                    try:
                        if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(name, dir_fd=dirfd)
                            deleted += 1
                    except FileNotFoundError:  # renamed into place or deleted meanwhile
                        continue
        return deleted

    # ---- the walk
    @contextmanager
    def _folder(self, key: str, create: bool = False) -> Iterator[tuple[int, str]]:
        """A descriptor of the folder that holds ``key``'s object, and the object's name in it."""
        *folders, name = check_key(key).split("/")
        with self._folders(folders, key, create) as fd:
            yield fd, name

    @contextmanager
    def _folders(self, parts: list[str], key: str, create: bool = False) -> Iterator[int]:
        """A descriptor of the folder ``parts`` name under the root, opened one part at a time,
        none through a link (``create``: the missing ones made, the root included)."""
        if parts:
            check_key("/".join(parts))
        try:
            fd = os.open(self.root, _FOLDER)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.root, exist_ok=True)  # the operator's path, made on the first write
            fd = os.open(self.root, _FOLDER)
        try:
            for part in parts:
                try:
                    try:
                        inner = os.open(part, _FOLDER, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise
                        try:
                            os.mkdir(part, dir_fd=fd)
                        except FileExistsError:  # made by another writer meanwhile
                            pass
                        inner = os.open(part, _FOLDER, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise LinkRefused(f"{self.url}: {key!r}: {part!r} is a link or not a folder; a store "
                                          "follows no links below its root") from None
                    raise
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _errors(self, key: str, writing: bool = False) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError as exc:
            if writing:
                raise StorageError(f"{self.url}: cannot write {key!r}: {exc.strerror or exc}") from exc
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LinkRefused(f"{self.url}: {key!r} is a symbolic link; a store follows no links below its "
                                  "root (copy the file itself into the folder)") from None
            raise StorageError(f"{self.url}: {key!r}: {exc.strerror or exc}") from exc


def _unlink_if_there(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
