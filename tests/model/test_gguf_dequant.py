"""berth's torch dequantisation (worker/model/gguf/dequant.py) against gguf.quants' numpy reference, bit
for bit: random blocks with the float16 scales forced to the awkward values (zeros of both signs,
subnormals, the largest finite, infinities, NaN), then the default model's own tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.paths import ROOT
from worker.model.gguf.dequant import BLOCK_TYPES, dequantise

# where each type keeps its float16 scales (d, and m/dmin where it has one)
F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF,
                        0x7C00, 0xFC00, 0x7E00, 0xFE01], dtype=np.uint16)


def reference(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    import gguf

    with np.errstate(invalid="ignore", over="ignore"):
        return torch.from_numpy(getattr(gguf.quants, type_name).dequantize_blocks(blocks))


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (signed zeros included), any NaN matching any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    assert torch.equal(got[~nan].view(as_int), want[~nan].view(as_int))


def random_blocks(type_name: str, n: int = 640, seed: int = 0) -> np.ndarray:
    """Random bytes (so every nibble, bit and 6-bit scale occurs many times), with each scale
    field running through SPECIAL_F16 against random values of the other fields, then random
    finite float16s of every size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, BLOCK_TYPES[type_name].type_size), dtype=np.uint8)
    for i, at in enumerate(F16_AT[type_name]):
        field = blocks[:, at:at + 2].view(np.uint16)[:, 0]
        special = np.roll(SPECIAL_F16, 5 * i)  # a different pairing of d and m
        field[:len(SPECIAL_F16) * 8] = np.tile(special, 8)
        sign = rng.integers(0, 2, size=n // 2, dtype=np.uint16) << 15
        field[n // 2:] = rng.integers(0, 0x7C00, size=n // 2, dtype=np.uint16) | sign  # finite
    return blocks


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_random_blocks_equal_reference(type_name):
    blocks = random_blocks(type_name)
    want = reference(type_name, blocks)
    assert want.isnan().any() and want.isinf().any() and (want == 0).any()  # the special scales did occur
    got = dequantise(type_name, torch.from_numpy(blocks), torch.float32)
    assert_bits_equal(got, want)
    # chunks that end inside the array, the last one short
    assert_bits_equal(dequantise(type_name, torch.from_numpy(blocks), torch.float32, chunk_values=7 * 256), want)
    for dtype in (torch.bfloat16, torch.float16):
        assert_bits_equal(dequantise(type_name, torch.from_numpy(blocks), dtype, chunk_values=5 * 256), want.to(dtype))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_unaligned_and_strided_bytes(type_name):
    """Blocks that do not start on a 4-byte boundary (copied to aligned memory first) read the same."""
    blocks = random_blocks(type_name, n=160, seed=1)
    buffer = np.zeros(blocks.size + 1, dtype=np.uint8)
    buffer[1:] = blocks.reshape(-1)
    shifted = torch.from_numpy(buffer)[1:].view(160, -1)
    assert_bits_equal(dequantise(type_name, shifted, torch.float32), reference(type_name, blocks))


def test_types_without_a_torch_version_are_declined():
    assert dequantise("Q2_K", torch.zeros(1, 84, dtype=torch.uint8), torch.float32) is None
    with pytest.raises(ValueError, match="Q4_1 blocks are 20 bytes"):
        dequantise("Q4_1", torch.zeros(2, 18, dtype=torch.uint8), torch.float32)


def test_default_model_tensors_equal_reference(smol_path):
    """The shipped Q4_1 file through read_tensor (its Q8_0 embedding, Q4_1 layers) in float32
    and bfloat16."""
    import gguf

    from worker.model.gguf.index import read_index
    from worker.model.gguf.tensors import open_data, read_tensor

    index, data = read_index(smol_path), open_data(smol_path)
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.attn_v.weight"]
    assert {gguf.GGMLQuantizationType(index.tensors[n].ggml_type).name for n in names} == {"Q8_0", "Q4_1"}
    for name in names:
        info = index.tensors[name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        n = int(np.prod(info.shape))
        blocks = np.asarray(data[info.offset:info.offset + n // block_size * type_size]).reshape(-1, type_size)
        want = reference(gguf.GGMLQuantizationType(info.ggml_type).name, blocks).reshape(info.shape)
        assert_bits_equal(read_tensor(data, info, torch.float32), want)
        assert_bits_equal(read_tensor(data, info, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K", "Q2_K", "Q3_K"])
def test_read_tensor_torch_and_numpy_paths(type_name):
    """read_tensor on bytes at an offset inside a buffer, shaped [rows, cols]: the torch types and
    the ones left to gguf.quants (Q2_K, Q3_K) both give the reference, in float32 and bfloat16."""
    import gguf

    from worker.model.gguf.index import TensorInfo
    from worker.model.gguf.tensors import read_tensor

    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (3, 2 * 256)
    n_blocks = shape[0] * shape[1] // block_size
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    data = np.concatenate([np.zeros(64, dtype=np.uint8), blocks.reshape(-1), np.zeros(7, dtype=np.uint8)])
    info = TensorInfo("t", int(qtype), shape, 64)
    want = reference(type_name, blocks).reshape(shape)
    assert_bits_equal(read_tensor(data, info, torch.float32), want)
    assert_bits_equal(read_tensor(data, info, torch.bfloat16), want.to(torch.bfloat16))


def test_berths_table_of_ggml_types_is_the_gguf_packages():
    import gguf

    from worker.model.gguf.tensors import GGML_TYPES, SUPPORTED_TYPES

    assert sorted(name for name, _, _ in GGML_TYPES.values()) == sorted(SUPPORTED_TYPES)
    for type_id, (name, block_size, type_size) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert kind.name == name and gguf.GGML_QUANT_SIZES[kind] == (block_size, type_size), name


def test_reading_the_default_model_needs_no_gguf_package(smol_path, tmp_path):
    """Its Q4_1, Q8_0 and float tensors are read without `import gguf` (0.04-0.1 s of a worker's start):
    dequantised (an empty weights cache) and written to the cache, then mapped from it."""
    script = ("import sys, torch\n"
              "from worker.model.gguf.index import read_index\n"
              "from worker.model.gguf.loader import gguf_config, gguf_weights\n"
              f"index = read_index({smol_path!r})\n"
              "weights = gguf_weights(index, gguf_config(index), torch.float32)\n"
              "again = gguf_weights(index, gguf_config(index), torch.float32)\n"
              "print(len(weights), len(again), 'gguf' in sys.modules)")
    root = ROOT
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(root), "BERTH_CACHE_DIR": str(tmp_path / "cache")},
                          timeout=300)
    assert done.returncode == 0, done.stderr
    count, again, imported = done.stdout.split()[-3:]
    assert int(count) > 100 and again == count and imported == "False"
    assert list((tmp_path / "cache" / "weights").glob("*.safetensors"))
