"""The Triton paged-attention kernels against their PyTorch reference, under the Triton interpreter.

Every test builds random caches (random values everywhere, so a read of a wrong slot, of padding or
past a context shows), block tables of shuffled block ids padded with other valid ids, and compares
with ``kernels.reference`` on the same inputs. Tolerances, elementwise (``torch.testing.assert_close``):

- float32: 1e-4 absolute (the interpreter multiplies exactly; what differs is the summation order);
- bfloat16: 2e-2 absolute + 2e-2 relative (bfloat16 values near 2 are 1.6e-2 apart: the reference
  rounds its output to them, and the interpreter truncates rather than rounds when it stores bfloat16);
- float16: 5e-3 absolute + 5e-3 relative.

The interpreter cannot multiply bfloat16, so there the kernels take their matrix products of
bfloat16 inputs in float32: these tests check the indexing, masking, softmax, loads and stores, not
the rounding of bfloat16 tensor-core products (``benchmarks/kernels_bench.py`` checks that on a GPU).

Quantized caches (``kernels.kv_quant``, int8 and fp8_e4m3) keep the same tolerances: the kernels
dequantise a row exactly as the reference does (the float32 product of value and scale, rounded to
the query's dtype), so what differs is still only the summation order. ``write_kv`` must store the
reference's very bytes.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from types import SimpleNamespace

# imported while collecting an earlier test module (transformers' models import it): then its interpreter was
# not asked for, and these kernels fail on the CPU ("Cannot call @triton.jit'd outside of the scope of a kernel")
_TRITON_BEFORE = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when a kernel is defined, so before the import

import pytest  # noqa: E402 (after the interpreter is asked for)
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need the triton package: pip install 'berth[test]'")

from kernels import kv_quant, reference  # noqa: E402

# A module imported earlier in this session without the interpreter holds compiled kernels, which
# cannot take CPU tensors: define them again, now interpreted.
_ALREADY_IMPORTED = "kernels.triton_attention" in sys.modules
triton_attention = importlib.import_module("kernels.triton_attention")
if _ALREADY_IMPORTED:
    triton_attention = importlib.reload(triton_attention)



def test_triton_is_first_imported_here_with_its_interpreter():
    assert not _TRITON_BEFORE, ("a test module collected before tests/kernels imports triton at its top (as "
                                "`from transformers import LlamaForCausalLM` does): import it inside its tests")


TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 0.0},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}
HEAD_DIM = 64
NUM_KV_HEADS = 2
SCALE = HEAD_DIM ** -0.5


def make_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def shuffled_block_tables(context_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables giving each sequence distinct blocks in shuffled order, padded with other
    sequences' (valid) block ids; returns them and the number of blocks the cache needs."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that belong to nobody
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = ids[start:start + count]
        start += count
    return tables.to(torch.int32), num_blocks


def decode_inputs(context_lens: list[int], block_size: int, queries_per_kv: int, dtype: torch.dtype,
                  seed: int, head_dim: int = HEAD_DIM) -> tuple:
    """``(q, k_cache, v_cache, block_tables, context_lens)`` for ``paged_decode_attention``."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = shuffled_block_tables(context_lens, block_size, gen)
    k_cache, v_cache = make_caches(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, gen)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * queries_per_kv, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def prefill_inputs(batch: list[tuple[int, int]], block_size: int, queries_per_kv: int, dtype: torch.dtype,
                   seed: int) -> tuple:
    """``(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)`` for
    ``paged_prefill_attention``; ``batch`` lists (cached tokens before the chunk, chunk length)."""
    gen = torch.Generator().manual_seed(seed)
    context_lens = [cached + chunk for cached, chunk in batch]
    tables, num_blocks = shuffled_block_tables(context_lens, block_size, gen)
    k_cache, v_cache = make_caches(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, gen)
    chunk_lens = [chunk for _, chunk in batch]
    query_start_loc = torch.tensor([0, *itertools.accumulate(chunk_lens)], dtype=torch.int32)
    q = torch.randn(sum(chunk_lens), NUM_KV_HEADS * queries_per_kv, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, query_start_loc, torch.tensor(context_lens, dtype=torch.int32)


def dtype_id(value) -> str | None:
    """Readable test ids for dtypes: ``float32`` rather than ``dtype0``."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[expected.dtype])


# --------------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("key_dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)], ids=dtype_id)
def test_write_kv_matches_reference(block_size, key_dtype, cache_dtype):
    """Exact equality, with strided key/value views (slices of one qkv tensor) and 3 kv heads."""
    gen = torch.Generator().manual_seed(block_size)
    num_kv_heads, num_blocks, num_tokens = 3, 5, 23
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, HEAD_DIM, cache_dtype, gen)
    # Values a bfloat16 cache holds exactly: the interpreter truncates float32 -> bfloat16, the GPU rounds.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16).to(key_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, expected_k, expected_v, slots)
    triton_attention.write_kv(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


KV_FORMATS = list(kv_quant.FORMATS)


def ties(fmt: str) -> torch.Tensor:
    """A row whose scale is exactly 1 (its largest value is the format's ``max_value``) and whose other
    values fall halfway between two stored values, or just under a step that carries into the next
    exponent: rounding ties to even and the carry must both match ``torch``'s."""
    if fmt == "int8":
        row = [127.0, 63.5, 62.5, -0.5, 0.5, 1.5, 126.5, -126.5, 2.4999, 0.0]
    else:  # e4m3 steps: 2 in [16, 32), 2^-9 below 2^-6; 7.76 and 15.9 round up into the next exponent
        row = [448.0, 17.0, 19.0, -17.0, 2 ** -10, 3 * 2 ** -10, 7.76, 15.9, 447.0, 1e-6]
    return torch.tensor(row + [0.0] * (HEAD_DIM - len(row)))


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_write_kv_quantizes_as_the_reference(fmt, key_dtype):
    """The bytes the reference stores (values and scales), with strided key/value views, 3 kv heads,
    rows from 1e-4 to 1e2 (fp8 subnormals among them), an all-zero row and rows of ties."""
    gen = torch.Generator().manual_seed(len(fmt))
    num_kv_heads, num_blocks, num_tokens, block_size = 3, 5, 23, 16
    caches = make_caches(num_blocks, block_size, num_kv_heads, HEAD_DIM, torch.float32, gen)
    k_cache, v_cache = (kv_quant.quantize(c, fmt) for c in caches)
    kv = torch.randn(num_tokens, 2 * num_kv_heads, HEAD_DIM, generator=gen)
    kv *= torch.logspace(-4, 2, num_tokens)[:, None, None]
    kv[3, 1] = 0.0
    kv[5, :] = ties(fmt)
    kv[6, :] = -ties(fmt) * 0.25  # a scale of 1/4: the same ties, scaled exactly
    kv = kv.to(key_dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, expected_k, expected_v, slots)
    triton_attention.write_kv(key, value, k_cache, v_cache, slots)

    assert k_cache.dtype == kv_quant.FORMATS[fmt].storage_dtype
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


def quantized(inputs: tuple, fmt: str) -> tuple:
    """Attention inputs with their K and V caches quantized to ``fmt``."""
    q, k_cache, v_cache, *rest = inputs
    return (q, kv_quant.quantize(k_cache, fmt), kv_quant.quantize(v_cache, fmt), *rest)


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(block_size, queries_per_kv, dtype):
    """Contexts of one token, under a block, and over one and two KV tiles, none block-aligned."""
    inputs = decode_inputs([1, 15, 33, 97, 130], block_size, queries_per_kv, dtype, seed=queries_per_kv)
    assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE),
                   reference.paged_decode_attention(*inputs, SCALE))


def test_decode_mixed_lengths_batch():
    """One batch mixing contexts from 1 to 2,000 tokens, around block and tile boundaries."""
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 129, 255, 511, 777, 1024, 1500, 1999, 2000]
    inputs = decode_inputs(lengths, 16, 3, torch.float32, seed=7)
    assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE),
                   reference.paged_decode_attention(*inputs, SCALE))


@pytest.mark.parametrize("num_splits, dtype", [(2, torch.float32), (7, torch.bfloat16), (40, torch.float32)],
                         ids=dtype_id)
def test_decode_split_k_matches_reference(num_splits, dtype):
    """Flash decoding: long and short contexts split in shares, some of them empty."""
    inputs = decode_inputs([1, 50, 1000, 1337], 16, 4, dtype, seed=num_splits)
    assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE, num_splits=num_splits),
                   reference.paged_decode_attention(*inputs, SCALE))


@pytest.mark.parametrize("block_size, head_dim, dtype", [(16, 128, torch.float32), (64, 128, torch.float16)],
                         ids=dtype_id)
def test_decode_other_shapes(block_size, head_dim, dtype):
    """head_dim 128, float16 and a block size above the KV tile."""
    inputs = decode_inputs([5, 100, 200], block_size, 2, dtype, seed=block_size, head_dim=head_dim)
    scale = head_dim ** -0.5
    assert_matches(triton_attention.paged_decode_attention(*inputs, scale),
                   reference.paged_decode_attention(*inputs, scale))


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("block_size, queries_per_kv, dtype", [
    (16, 3, torch.float32), (32, 8, torch.bfloat16), (16, 2, torch.float16)], ids=dtype_id)
def test_decode_quantized_cache_matches_reference(fmt, block_size, queries_per_kv, dtype):
    """Int8 and fp8 caches read in place: one split and three, full attention and a 20-token window."""
    inputs = quantized(decode_inputs([1, 15, 33, 97, 130, 300], block_size, queries_per_kv, dtype,
                                     seed=block_size), fmt)
    for window in (None, 20):
        expected = reference.paged_decode_attention(*inputs, SCALE, window)
        for splits in (1, 3):
            assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE, window, num_splits=splits),
                           expected)


# --------------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------------

# (cached tokens before the chunk, chunk length) per sequence: a fresh prompt over two KV tiles, a
# chunk at an unaligned offset, a single-token chunk, an empty chunk, a chunk at a block-aligned offset.
PREFILL_BATCH = [(0, 70), (105, 45), (36, 1), (20, 0), (64, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(block_size, queries_per_kv, dtype):
    """Chunks at cached offsets and fresh prompts, several query tiles per sequence."""
    inputs = prefill_inputs(PREFILL_BATCH, block_size, queries_per_kv, dtype, seed=100 + queries_per_kv)
    assert_matches(triton_attention.paged_prefill_attention(*inputs, SCALE),
                   reference.paged_prefill_attention(*inputs, SCALE))


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("queries_per_kv, dtype", [(1, torch.float32), (3, torch.bfloat16)], ids=dtype_id)
def test_prefill_quantized_cache_matches_reference(fmt, queries_per_kv, dtype):
    """Chunks over int8 and fp8 caches, full attention and a 20-token window."""
    inputs = quantized(prefill_inputs(PREFILL_BATCH, 16, queries_per_kv, dtype, seed=300 + queries_per_kv), fmt)
    for window in (None, 20):
        assert_matches(triton_attention.paged_prefill_attention(*inputs, SCALE, window),
                       reference.paged_prefill_attention(*inputs, SCALE, window))


# --------------------------------------------------------------------------------------------------
# sliding windows (the reference's own window is checked against a dense mask in test_cpu_kernel.py)
# --------------------------------------------------------------------------------------------------

# One token, not a multiple of the block size, one KV tile, equal to a context (130), longer than all.
WINDOWS = [1, 20, 64, 130, 5000]


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_matches_reference(window):
    """Contexts shorter and longer than the window, one split and three (whose first splits may
    hold only tiles before the window: skipped, so empty)."""
    for block_size, queries_per_kv, dtype in [(16, 3, torch.float32), (32, 8, torch.bfloat16)]:
        inputs = decode_inputs([1, 15, 33, 97, 130, 300], block_size, queries_per_kv, dtype, seed=window)
        expected = reference.paged_decode_attention(*inputs, SCALE, window)
        assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE, window), expected)
        assert_matches(triton_attention.paged_decode_attention(*inputs, SCALE, window, num_splits=3), expected)


@pytest.mark.parametrize("window", [1, 20, 48, 130])
def test_prefill_window_matches_reference(window):
    """Chunks longer than the window and chunks whose window reaches back into cached blocks. With one
    query head per kv head a program holds 64 query tokens, so its last rows' windows begin tiles
    after its first row's: those rows see nothing in the first tiles (and must not turn NaN)."""
    batch = PREFILL_BATCH + [(150, 90)]
    for queries_per_kv, dtype in [(1, torch.float32), (3, torch.bfloat16)]:
        inputs = prefill_inputs(batch, 16, queries_per_kv, dtype, seed=200 + window)
        assert_matches(triton_attention.paged_prefill_attention(*inputs, SCALE, window),
                       reference.paged_prefill_attention(*inputs, SCALE, window))


# --------------------------------------------------------------------------------------------------
# host side: shape checks, no synchronization
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size, head_dim, message", [(16, 96, "head_dim"), (8, 64, "block_size")])
def test_rejects_unsupported_shapes(block_size, head_dim, message):
    inputs = decode_inputs([5], block_size, 1, torch.float32, seed=0, head_dim=head_dim)
    with pytest.raises(AssertionError, match=message):
        triton_attention.paged_decode_attention(*inputs, SCALE)


def test_default_num_splits_fills_the_gpu_only_when_needed(monkeypatch):
    """Two programs per multiprocessor: split few long sequences, never many or short ones."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda", 0)
    assert triton_attention.default_num_splits(1 * 8, 32768, cuda) == triton_attention.MAX_SPLITS
    assert triton_attention.default_num_splits(8 * 8, 32768, cuda) == 264 // 64
    assert triton_attention.default_num_splits(1 * 8, 1024, cuda) == 1024 // triton_attention.MIN_TOKENS_PER_SPLIT
    assert triton_attention.default_num_splits(64 * 8, 32768, cuda) == 1
    assert triton_attention.default_num_splits(1, 32768, torch.device("cpu")) == 1


def test_wrappers_read_no_tensor_values(monkeypatch):
    """The wrappers must not synchronize with the device: no ``.item()``, ``.tolist()``, ``int(t)``..."""
    decode = decode_inputs([3, 40], 16, 2, torch.float32, seed=0)
    prefill = prefill_inputs([(0, 5), (7, 3)], 16, 2, torch.float32, seed=0)
    kv = torch.zeros(2, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 5])

    def forbidden(*args, **kwargs):
        raise AssertionError("a wrapper read a tensor's value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    triton_attention.paged_decode_attention(*decode, SCALE)
    triton_attention.paged_decode_attention(*decode, SCALE, num_splits=2)
    triton_attention.paged_decode_attention(*decode, SCALE, 20, num_splits=2)
    triton_attention.paged_prefill_attention(*prefill, SCALE)
    triton_attention.paged_prefill_attention(*prefill, SCALE, 4)
    triton_attention.write_kv(kv, kv, decode[1], decode[2], slots)


@pytest.fixture(scope="module")
def windowed_loaded(tmp_path_factory, smol_tokenizer):
    """A tiny random Mistral whose 20-token window the prompts below pass."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.support.models import save_tiny_model
    from worker.model.loader import load_model

    path = save_tiny_model(MistralConfig, MistralForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("mistral"),
                           sliding_window=20)
    return load_model(str(path), torch.float32)


@pytest.mark.parametrize("model, kv_cache_dtype", [
    ("tiny_loaded", "auto"), ("windowed_loaded", "auto"), ("tiny_loaded", "int8")])
def test_engine_with_triton_kernels_matches_the_torch_path(model, kv_cache_dtype, request, text_ids):
    """The engine behind the attention interface, once with the Triton kernels (interpreted here),
    once with PyTorch: chunked prefill and decode give the same greedy tokens, with and without a
    sliding window, and on an int8 cache (the backend Triton picks on CUDA for it too)."""
    from tests.support.models import cut_prompts
    from worker.engine.engine import Engine
    from worker.engine.request import SamplingParams

    tiny_loaded = request.getfixturevalue(model)
    prompts = cut_prompts(text_ids, [5, 23, 40])
    params = SamplingParams(max_tokens=6, temperature=0, min_tokens=6)
    tokens = {}
    for backend in ("triton", "torch"):
        engine = Engine(loaded=tiny_loaded, kv_memory="8MiB", block_size=16, max_num_batched_tokens=32,
                        attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
        assert engine.runner.ops.name == backend
        assert kv_quant.is_quantized(engine.runner.kv_caches[0][0]) == (kv_cache_dtype != "auto")
        tokens[backend] = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
