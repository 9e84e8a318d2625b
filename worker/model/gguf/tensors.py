"""A GGUF tensor's bytes as a torch tensor in the compute dtype.

Float data that already is the compute dtype is not copied: it is a view of the file's memory map
(copy-on-write, so the file is never written and torch gets the writable array it asks for).
Quantised data of the common types (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) is dequantised with
torch by ``worker.model.gguf.dequant``, straight from the memory map and bit for bit what ``gguf.quants``
gives, several times faster (benchmarks/HISTORY.md). The other types (Q2_K, Q3_K) keep
``gguf.quants`` (the reference numpy code that llama.cpp's Python tools use), driven a few thousand
blocks at a time: the working arrays then stay in the CPU cache, which is several times faster than
both one pass over a whole tensor and ``gguf.quants.dequantize``'s own grouping of 16 rows.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.model.base import ModelLoadError
from worker.model.gguf.dequant import dequantise
from worker.model.gguf.index import TensorInfo

_FLOATS = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.int16, torch.bfloat16)}
# The block quantisations of llama.cpp's common file types (Q4_K_M holds Q4_K and Q6_K, etc.)
QUANTISED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*_FLOATS, *QUANTISED)
# GGML type id -> (name, values per block, bytes per block) of the types above, as GGUF files number and
# size them (tests/model/test_gguf_dequant.py holds it equal to the gguf package's GGML_QUANT_SIZES). Written
# here so that reading the common files needs no `import gguf` (its metadata module brings PyYAML).
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18),
              3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
_BLOCKS_PER_CHUNK = 4096


def open_data(path: str) -> np.memmap:
    """The whole file as bytes, mapped copy-on-write."""
    return np.memmap(path, dtype=np.uint8, mode="c")


def read_tensor(data: np.memmap, info: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """``info``'s tensor from the mapped file ``data``, shaped ``info.shape``, in ``dtype``."""
    if info.ggml_type not in GGML_TYPES:
        raise ModelLoadError(f"tensor {info.name} is stored as {_type_name(info.ggml_type)}, which berth cannot "
                             f"read; it reads {', '.join(SUPPORTED_TYPES)}: pick a file quantised to one of those")
    type_name, block_size, type_size = GGML_TYPES[info.ggml_type]
    n = int(np.prod(info.shape))
    raw = data[info.offset:info.offset + n // block_size * type_size]
    if type_name in _FLOATS:
        np_dtype, view_as = _FLOATS[type_name]
        tensor = torch.from_numpy(raw.view(np_dtype).reshape(info.shape))
        return (tensor.view(view_as) if view_as else tensor).to(dtype)
    if info.shape[-1] % block_size:
        raise ModelLoadError(f"tensor {info.name} has rows of {info.shape[-1]} values, not a multiple of "
                             f"{type_name}'s block of {block_size}: the file is damaged")
    blocks = raw.reshape(-1, type_size)
    tensor = dequantise(type_name, torch.from_numpy(blocks), dtype)
    if tensor is None:
        import gguf.quants

        tensor = _dequantise(getattr(gguf.quants, type_name), blocks, dtype)
    return tensor.reshape(info.shape)


def _type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"GGML type {ggml_type}"


def _dequantise(quant, blocks: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """numpy all the way, then one conversion: small torch copies per chunk cost far more, as each
    wakes torch's thread pool."""
    out = np.empty((blocks.shape[0], quant.block_size), dtype=np.float32)
    for start in range(0, blocks.shape[0], _BLOCKS_PER_CHUNK):
        out[start:start + _BLOCKS_PER_CHUNK] = quant.dequantize_blocks(blocks[start:start + _BLOCKS_PER_CHUNK])
    return torch.from_numpy(out).to(dtype)
