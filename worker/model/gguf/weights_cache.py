"""A GGUF model's weights as the engine uses them (dequantised, in its dtype, Q/K rows unpermuted),
kept in a file under ``cache_dir("weights")`` so that a restart maps them instead of computing them.

Dequantising the default model's Q4_1 file costs about half a CPU second at every start
(benchmarks/HISTORY.md, start-up); a worker restarted after a crash pays it again before it can
continue. The first load writes the weights it computed; later loads map that file copy-on-write,
which costs almost nothing until the pages are read (they are in the page cache when the same host
started the model before), and the mapped pages of weights used as they lie (the embeddings, the
norms) are shared by every worker of the host.

The file is safetensors (a JSON header, then the tensors' bytes back to back), so any safetensors
reader can open it. Each layer's tensors are written in the order the decoder fuses them (Q, K, V;
gate, up), one after another, so that the decoder can view a fused weight instead of copying it
(``worker.model.decoder``). One file per model file and dtype (its name hashes the model's resolved
path and the dtype); its header says what it was made from: the model file's size, modification
time and tensor index, the dtype, this format's version and a digest of the code that computes the
weights. A file whose header does not match, or that is cut short or damaged, is not read: the
weights are computed again and the file rewritten (written to a temporary file and renamed, so a
reader never sees a torn one). Files whose model file is gone or changed are removed when a new
one is written. Where the folder cannot be written or lacks the room, the model loads as before and
the reason is logged once.

Bit rot inside the tensors' bytes is not detected (checking it would cost the time saved); the
folder, like the rest of ``BERTH_CACHE_DIR``, is safe to delete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from worker.config import cache_dir
from worker.model.gguf.index import GGUFIndex

log = logging.getLogger(__name__)

FORMAT = "1"
# the code whose change changes the weights computed: a new digest makes the old entries stale
_SOURCES = ("loader.py", "tensors.py", "dequant.py", "weights_cache.py")
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_HEADER_ALIGN = 64  # the header is padded with spaces so that the data starts on this boundary
_ROOM_MARGIN = 1 << 30  # bytes left free on the cache's disk after writing a file
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_SECONDS = 3600  # a temporary file older than this was left by a process that died writing it
_logged: set[str] = set()


@dataclass(frozen=True)
class Entry:
    """Where the weights of one model file in one dtype are cached, and what its header must say."""
    file: Path
    identity: dict[str, str]


def entry_for(index: GGUFIndex, dtype: torch.dtype) -> Entry | None:
    """The cache entry of ``index``'s weights in ``dtype``; None where the dtype is not cached or the
    model file cannot be read."""
    if dtype not in _DTYPES:
        return None
    source = Path(index.path).resolve()
    try:
        stat = source.stat()
    except OSError:
        return None
    identity = {"format": FORMAT, "code": _code_digest(), "source": str(source), "size": str(stat.st_size),
                "mtime_ns": str(stat.st_mtime_ns), "tensors": _index_digest(index), "dtype": _DTYPES[dtype]}
    name = hashlib.sha256(f"{source}\n{_DTYPES[dtype]}".encode()).hexdigest()[:24]
    return Entry(cache_dir("weights") / f"{name}.safetensors", identity)


def cached(entry: Entry | None, shapes: dict[str, tuple[int, ...]],
           compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The weights named and shaped as ``shapes``: mapped from ``entry``'s file where it holds them,
    else ``compute()``, then written to it for the next load."""
    if entry is None:
        return compute()
    weights = read(entry, shapes)
    if weights is not None:
        return weights
    weights = compute()
    write(entry, weights)
    return weights


def read(entry: Entry, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
    """The tensors of ``entry``'s file as views of its copy-on-write map; None (the reason logged
    once) where it is missing, stale or damaged."""
    try:
        data = np.memmap(entry.file, dtype=np.uint8, mode="c")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        _log_once(f"weights cache {entry.file} unreadable ({exc}): computing the weights again")
        return None
    try:
        return _tensors(data, entry, shapes)
    except _Stale as exc:
        log.info("weights cache %s is stale (%s): computing the weights again", entry.file, exc)
    except (ValueError, KeyError, TypeError, struct.error, RuntimeError) as exc:
        _log_once(f"weights cache {entry.file} is damaged ({exc}): computing the weights again and rewriting it")
    return None


class _Stale(Exception):
    """The file is whole, but of another model file, dtype, format or code."""


def _tensors(data: np.memmap, entry: Entry, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    (length,) = struct.unpack_from("<Q", data, 0)
    if not 8 <= 8 + length <= len(data):
        raise ValueError(f"a header of {length} bytes in a file of {len(data)}")
    header = json.loads(bytes(data[8:8 + length]))
    metadata = header.pop("__metadata__", {})
    changed = sorted(k for k, v in entry.identity.items() if metadata.get(k) != v)
    if changed:
        raise _Stale("its " + ", ".join(changed) + " differ")
    if set(header) != set(shapes):
        raise ValueError(f"it holds {len(header)} tensors, not the model's {len(shapes)}")
    start = 8 + length
    flat = torch.from_numpy(data)
    dtype = next(t for t, name in _DTYPES.items() if name == entry.identity["dtype"])
    size = torch.empty((), dtype=dtype).element_size()
    weights = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if info["dtype"] != entry.identity["dtype"] or shape != tuple(shapes[name]):
            raise ValueError(f"{name} is {info['dtype']} {shape}, not {entry.identity['dtype']} {tuple(shapes[name])}")
        if not 0 <= begin <= end <= len(data) - start or end - begin != size * int(np.prod(shape)):
            raise ValueError(f"{name}'s bytes {begin}..{end} do not fit its shape or the file")
        weights[name] = flat[start + begin:start + end].view(dtype).view(shape)
    return weights


def write(entry: Entry, weights: dict[str, torch.Tensor]) -> None:
    """``weights`` to ``entry``'s file, atomically; on failure the reason is logged once and nothing
    else happens (the weights are already computed)."""
    dtype = entry.identity["dtype"]
    names = sorted(weights, key=_write_order)
    tensors = [weights[n].detach().to("cpu").contiguous() for n in names]
    header, offset = {}, 0
    for name, t in zip(names, tensors):
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = entry.identity
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
    folder = entry.file.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        if free < 8 + len(text) + offset + _ROOM_MARGIN:
            _log_once(f"not caching the model's weights in {folder}: {offset / 2**20:.0f} MiB would leave less than "
                      f"{_ROOM_MARGIN >> 30} GiB free; each start computes them again (free room there, or set "
                      "BERTH_CACHE_DIR to a folder with room)")
            return
        _prune(folder, keep=entry.file)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TEMP_PREFIX, suffix=".safetensors")
        try:
            os.fchmod(fd, 0o644)  # as the folder's other files: workers of other users may map it
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for t in tensors:
                    f.write(t.view(torch.uint8).numpy().data if t.numel() else b"")
            os.replace(tmp, entry.file)  # atomic: a reader sees the old file or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        _log_once(f"cannot write the weights cache in {folder} ({exc}): each start computes the model's weights "
                  "again; set BERTH_CACHE_DIR to a writable folder to keep them")


# the decoder fuses these of a layer into one weight (worker.model.architectures): written back to back
_FUSED_ORDER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _write_order(name: str) -> tuple:
    """Layers in order; in each, weights then biases, and the parts of a fused weight in their order."""
    parts = name.split(".")
    layer = int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1
    module = ".".join(parts[3:-1]) if layer >= 0 else name
    rank = _FUSED_ORDER.index(module) if module in _FUSED_ORDER else len(_FUSED_ORDER)
    return (layer, parts[-1], rank, name)


def _prune(folder: Path, keep: Path) -> None:
    """Remove the files of model files that are gone or changed, and temporary files of writers that died."""
    for path in folder.glob("*.safetensors"):
        try:
            if path.name.startswith(_TEMP_PREFIX):
                if time.time() - path.stat().st_mtime > _STALE_TEMP_SECONDS:
                    path.unlink()
                continue
            if path == keep:
                continue
            metadata = _metadata(path)
            source = Path(metadata.get("source", ""))
            stat = source.stat() if metadata.get("source") else None
            if stat is None or str(stat.st_size) != metadata.get("size") or \
                    str(stat.st_mtime_ns) != metadata.get("mtime_ns"):
                path.unlink()
        except (FileNotFoundError, ValueError, struct.error):  # its model file is gone, or it is damaged
            path.unlink(missing_ok=True)
        except OSError:
            continue  # not ours to read: left for a person (the folder is safe to delete)


def _metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 1 << 26:
            raise ValueError("header too long")
        return json.loads(f.read(length)).get("__metadata__", {})


def _index_digest(index: GGUFIndex) -> str:
    """The model file's tensors: names, types, shapes and where they lie (a file rewritten with the
    same size and time, e.g. by `cp -p` of another conversion, still differs here)."""
    text = "\n".join(f"{i.name} {i.ggml_type} {i.shape} {i.offset}" for i in index.tensors.values())
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_code: str | None = None


def _code_digest() -> str:
    global _code
    if _code is None:
        folder = Path(__file__).parent
        _code = hashlib.sha256(b"".join((folder / name).read_bytes() for name in _SOURCES)).hexdigest()[:24]
    return _code


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.warning("%s", message)
