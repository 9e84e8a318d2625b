"""The object-store interface every berth store implements, and its errors.

Keys are ``/``-separated names made by berth from ids and hashes (``check_key`` enforces the
alphabet, and no part starts with a dot: stores keep those names for their own files), never from
user text. ``put`` is atomic: a reader sees the old object or the new one, never a mix. ``open`` and
``writer`` stream large objects (job files) without holding them in memory; what ``writer`` writes
appears, atomically too, when its block ends without an error.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO

_KEY = re.compile(r"[A-Za-z0-9_.=-]+(/[A-Za-z0-9_.=-]+)*")


class StorageError(Exception):
    """The store could not be reached or refused an operation; the message says which and why."""


class ObjectNotFound(LookupError):
    """No object under that key."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # seconds since the epoch


def check_key(key: str) -> str:
    """``key`` if it is a safe object name: letters, digits, ``_.=-`` in ``/``-separated parts."""
    if len(key) > 512 or not _KEY.fullmatch(key) or any(part.startswith(".") for part in key.split("/")):
        raise ValueError(f"{key[:100]!r} is not an object key berth makes (letters, digits, '_.=-', '/'; "
                         "no part starting with '.')")
    return key


class ObjectStore(ABC):
    url: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically, replacing what was there."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; ``ObjectNotFound`` when there is none."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of the object from byte ``start`` (fewer at its end); ``ObjectNotFound``
        when there is none. Stores that can read a range alone override this whole-object read."""
        return self.get(key)[start:start + length]

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """The object as a file to read (close it); ``ObjectNotFound`` when there is none."""

    @abstractmethod
    def writer(self, key: str) -> AbstractContextManager[BinaryIO]:
        """``with store.writer(key) as f: f.write(...)``: an object of any size, stored atomically on exit."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; nothing happens when there is none."""
