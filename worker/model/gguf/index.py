"""The index of a GGUF file: its metadata and where each tensor lies, read without its vocabulary.

``gguf.GGUFReader`` builds Python objects for every element of every array, so the tokenizer's
tens of thousands of tokens and merges cost seconds before the first config field can be read. Here
the header is read straight from a memory map: numeric arrays become numpy views, string arrays are
stepped over (only their length prefixes are read, no string is decoded) and kept as a count and an
offset, so a caller that wants them can still read them. Tensor data is not touched.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from worker.model.base import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> its numpy dtype (little-endian); 8 (string) and 9 (array) are variable-sized
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class StringArray:
    """An array of strings left unread: ``count`` strings starting at byte ``offset`` of the file."""
    count: int
    offset: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # outermost dimension first, as torch and Hugging Face write it
    offset: int  # absolute byte offset of the data in the file


@dataclass(frozen=True)
class GGUFIndex:
    path: str
    version: int
    metadata: Mapping[str, object]  # str, int, float, bool, a numpy array, or a StringArray
    tensors: Mapping[str, TensorInfo]  # in file order


def read_index(path: str | Path) -> GGUFIndex:
    """The metadata and tensor index of the GGUF file at ``path``."""
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise ModelLoadError(f"{path} is not a GGUF file ({exc})") from exc
    with mm:
        try:
            return _parse(mm, str(path))
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file: its header is cut short or "
                                 f"damaged ({exc}); download or convert it again") from exc


def _parse(mm: mmap.mmap, path: str) -> GGUFIndex:
    if mm[:4] != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    version = _U32.unpack_from(mm, 4)[0]
    if version not in (2, 3):
        hint = ("it looks big-endian: convert it on a little-endian machine"
                if version & 0xFFFF == 0 else "berth reads GGUF versions 2 and 3")
        raise ModelLoadError(f"{path} is GGUF version {version}: {hint}")
    n_tensors, n_kv = _U64.unpack_from(mm, 8)[0], _U64.unpack_from(mm, 16)[0]
    reader = _Reader(mm, 24)
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.u32())
    infos = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.u64() for _ in range(reader.u32())]
        infos.append((name, reader.u32(), tuple(reversed(dims)), reader.u64()))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.offset // alignment) * alignment
    tensors = {name: TensorInfo(name, ggml_type, shape, data_start + rel)
               for name, ggml_type, shape, rel in infos}
    return GGUFIndex(path, version, MappingProxyType(metadata), MappingProxyType(tensors))


class _Reader:
    """A cursor over the memory-mapped header."""

    def __init__(self, mm: mmap.mmap, offset: int):
        self.mm, self.offset = mm, offset

    def u32(self) -> int:
        self.offset += 4
        return _U32.unpack_from(self.mm, self.offset - 4)[0]

    def u64(self) -> int:
        self.offset += 8
        return _U64.unpack_from(self.mm, self.offset - 8)[0]

    def string(self) -> str:
        n = self.u64()
        self.offset += n
        return self.mm[self.offset - n:self.offset].decode("utf-8")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(self.u32(), self.u64())
        dtype = np.dtype(_SCALARS[vtype])
        self.offset += dtype.itemsize
        return np.frombuffer(self.mm, dtype, 1, self.offset - dtype.itemsize)[0].item()

    def array(self, etype: int, count: int):
        if etype == _STRING:
            start = self.offset
            self.offset = _skip_strings(self.mm, start, count)
            return StringArray(count, start)
        if etype == _ARRAY:
            return [self.array(self.u32(), self.u64()) for _ in range(count)]
        dtype = np.dtype(_SCALARS[etype])
        values = np.frombuffer(self.mm, dtype, count, self.offset).copy()  # the map closes after parsing
        self.offset += count * dtype.itemsize
        return values


def read_strings(path: str | Path, array: StringArray) -> list[str]:
    """The strings of an array the index left unread."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        reader = _Reader(mm, array.offset)
        return [reader.string() for _ in range(array.count)]


def _skip_strings(mm: mmap.mmap, offset: int, count: int) -> int:
    """The offset just past ``count`` length-prefixed strings: each start depends on the previous
    length, so this is a walk, but it reads one integer per string and builds no objects."""
    unpack = _U64.unpack_from
    for _ in range(count):
        offset += 8 + unpack(mm, offset)[0]
    if offset > len(mm):
        raise ValueError("a string array runs past the end of the file")
    return offset
