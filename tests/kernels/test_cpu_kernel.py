"""The C decode-attention kernel against the PyTorch reference, and its place in the engine; and the
reference's sliding window against a dense masked softmax written out here (these need no compiler)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu_attention, cpu_features, kv_quant, reference
from kernels.attention import select_ops
from worker.config import cache_dir

KERNEL = cpu_attention.load(cache_dir("kernels"))  # the worker's build folder, as the engine passes it
needs_c = pytest.mark.skipif(KERNEL is None, reason="no C compiler to build the CPU kernel")
# Both vector paths on every CPU that has AVX2: the one this CPU picks, and AVX2 + FMA forced (an
# AVX-512 CPU then tests what an AMD Zen 2/3 runs)
KERNELS = {"native": KERNEL, "avx2": cpu_attention.load(cache_dir("kernels"), isa="avx2") if KERNEL else None}
each_path = pytest.mark.parametrize("path", [
    pytest.param(name, marks=pytest.mark.skipif(k is None, reason=f"the {name} path cannot be built here"))
    for name, k in KERNELS.items()])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # bf16: one rounding of the output


def paged_case(context_lens, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-c // block_size) for c in context_lens)
    num_blocks = need + 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-c // block_size) for c in context_lens)
    tables, used = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(ids[used:used + n] + ids[-1:] * (width - n))  # pad with another sequence's block
        used += n
    q = torch.randn(len(context_lens), heads, head_dim, generator=g).to(dtype)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(context_lens, dtype=torch.int32), head_dim ** -0.5)


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 24])  # 24: runs cut by block edges on either path
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_decode_matches_reference(path, dtype, block_size, heads, kv_heads):
    lens = [1, 15, 16, 17, 33, 97, 130, 2000] + list(range(3, 600, 41))
    args = paged_case(lens, block_size, heads, kv_heads, 64, dtype)
    got = KERNELS[path].paged_decode_attention(*args)
    want = reference.paged_decode_attention(*args)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_few_long_sequences_split_over_threads_match_reference(path, dtype, threads):
    """Fewer sequences than the threads can share: each is cut into parts whose softmax states merge
    (split-K); the parts' edges fall inside windows and short sequences have empty parts."""
    args = paged_case([2000, 70, 1, 999], 16, 9, 3, 64, dtype, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 100, 1500):
            got = KERNELS[path].paged_decode_attention(*args, window=window)
            want = reference.paged_decode_attention(*args, window=window)
            torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    finally:
        torch.set_num_threads(before)


@needs_c
def test_head_dim_128_and_a_single_sequence():
    args = paged_case([77], 16, 8, 2, 128, torch.float32, seed=3)
    torch.testing.assert_close(KERNEL.paged_decode_attention(*args),
                               reference.paged_decode_attention(*args), atol=1e-5, rtol=1e-5)


@needs_c
def test_each_path_is_the_one_its_cpu_flags_choose():
    flags = cpu_features.cpu_flags()
    assert KERNEL.isa == ("avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "none")
    if KERNELS["avx2"] is not None:
        assert KERNELS["avx2"].isa == "avx2"
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_attention.load(cache_dir("kernels"), isa="sse9")


@needs_c
def test_unsupported_dtype_falls_back_to_reference():
    args = paged_case([5, 40], 16, 4, 2, 64, torch.float16)
    torch.testing.assert_close(KERNEL.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@needs_c
def test_auto_backend_on_cpu_is_the_c_kernel():
    assert select_ops("auto", "cpu", cache_dir("kernels")).name == "cpu"
    assert select_ops("torch", "cpu", cache_dir("kernels")).name == "torch"
    assert select_ops("auto", "cpu").name == "torch"  # no folder to build in: the PyTorch path


# --------------------------------------------------------------------------------------------------
# sliding windows
# --------------------------------------------------------------------------------------------------

# Contexts around block edges and past every window below, 40 sequences: the reference's grouped path
WINDOW_LENS = [1, 15, 16, 17, 33, 48, 49, 97, 130, 2000] + list(range(3, 600, 20))
# Windows of one token, not a multiple of any block size, a block, equal to a context (130), longer than all
WINDOWS = [1, 20, 32, 130, 5000]


def dense_attention(q, k_cache, v_cache, table, positions, context_len, scale, window):
    """Queries ``q`` ``[n, heads, d]`` at ``positions`` of one sequence over its first ``context_len``
    keys, in float64, with the mask written out: key k is seen from position p when
    ``k <= p`` and, with a window, ``k > p - window`` (transformers' sliding_window_causal_mask_function)."""
    block_size = k_cache.shape[1]
    blocks = table[: -(-context_len // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:context_len].double()  # [ctx, kv_heads, d]
    v = v_cache[blocks].flatten(0, 1)[:context_len].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    key, pos = torch.arange(context_len)[None, :], positions[:, None]
    seen = key <= pos
    if window is not None:
        seen &= key > pos - window
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_reference_decode_window_is_the_dense_mask(window):
    q, k, v, tables, lens, scale = paged_case(WINDOW_LENS, 16, 9, 3, 64, torch.float32, seed=5)
    got = reference.paged_decode_attention(q, k, v, tables, lens, scale, window)
    for s, n in enumerate(lens.tolist()):
        want = dense_attention(q[s:s + 1], k, v, tables[s], torch.tensor([n - 1]), n, scale, window)
        torch.testing.assert_close(got[s:s + 1].double(), want, atol=1e-5, rtol=1e-5)


# (cached tokens before the chunk, chunk length): fresh prompts longer than the windows, chunks at
# unaligned offsets whose first query's window starts blocks back, a single token, an empty chunk
PREFILL_WINDOW_BATCH = [(0, 70), (105, 45), (36, 1), (20, 0), (64, 32), (150, 90), (0, 130)]


@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_reference_prefill_window_is_the_dense_mask(window):
    contexts = [c + n for c, n in PREFILL_WINDOW_BATCH]
    _, k, v, tables, lens, scale = paged_case(contexts, 16, 9, 3, 64, torch.float32, seed=6)
    chunks = [n for _, n in PREFILL_WINDOW_BATCH]
    starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)
    q = torch.randn(sum(chunks), 9, 64, generator=torch.Generator().manual_seed(7))
    got = reference.paged_prefill_attention(q, k, v, tables, starts, lens, scale, window)
    for s, (cached, n) in enumerate(PREFILL_WINDOW_BATCH):
        lo = starts[s].item()
        want = dense_attention(q[lo:lo + n], k, v, tables[s], torch.arange(cached, cached + n), cached + n, scale,
                               window)
        torch.testing.assert_close(got[lo:lo + n].double(), want, atol=1e-5, rtol=1e-5)


def chunk_slots(tables, batch, block_size=16) -> torch.Tensor:
    """The cache slots of each sequence's chunk (positions cached .. cached + n - 1), in query order."""
    return torch.tensor([tables[s, p // block_size].item() * block_size + p % block_size
                         for s, (cached, n) in enumerate(batch) for p in range(cached, cached + n)], dtype=torch.long)


@pytest.mark.parametrize("window", [None, 20, 130])
def test_reference_prefill_over_its_own_keys_is_the_same_as_over_the_cache(window):
    """Given the chunks' own keys and values, prefill reads only the positions before each chunk from the
    cache; with a float cache, which holds those same rows, the output is the same bit for bit."""
    contexts = [c + n for c, n in PREFILL_WINDOW_BATCH]
    _, k, v, tables, lens, scale = paged_case(contexts, 16, 9, 3, 64, torch.float32, seed=8)
    chunks = [n for _, n in PREFILL_WINDOW_BATCH]
    starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)
    q = torch.randn(sum(chunks), 9, 64, generator=torch.Generator().manual_seed(9))
    key, value = (c.flatten(0, 1)[chunk_slots(tables, PREFILL_WINDOW_BATCH)] for c in (k, v))  # as written
    over_cache = reference.paged_prefill_attention(q, k, v, tables, starts, lens, scale, window)
    assert torch.equal(reference.paged_prefill_attention(q, k, v, tables, starts, lens, scale, window, key, value),
                       over_cache)


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (16, 9, 3, 64), (32, 16, 2, 64), (24, 4, 4, 64), (16, 8, 2, 128)])  # 24: runs cut by block edges; 128: plain C
def test_decode_window_matches_reference(path, dtype, block_size, heads, kv_heads, head_dim):
    args = paged_case(WINDOW_LENS, block_size, heads, kv_heads, head_dim, dtype, seed=block_size)
    for window in WINDOWS:
        got = KERNELS[path].paged_decode_attention(*args, window=window)
        want = reference.paged_decode_attention(*args, window=window)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# --------------------------------------------------------------------------------------------------
# the int8 KV cache (kernels/kv_quant.py): rows of int8 values and their float32 scale
# --------------------------------------------------------------------------------------------------

def test_int8_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]  # rows of every size
    x[7] = 0.0  # an all-zero row stays zero
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 68)
    back = kv_quant.dequantize(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-7 * x.abs()).all()
    assert torch.equal(back[7], torch.zeros(3, 64))
    assert (back - x).abs().max() > 0  # quantized, not stored as is


def test_write_kv_quantizes_into_an_int8_cache():
    g = torch.Generator().manual_seed(12)
    k_cache = torch.zeros(4, 16, 3, 68, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    slots = torch.tensor([0, 17, 18, 40, 63])
    reference.write_kv(key, value, k_cache, v_cache, slots)
    stored = kv_quant.dequantize(k_cache.view(-1, 3, 68)[slots], torch.float32)
    torch.testing.assert_close(stored, key, atol=0.02, rtol=0.02)
    torch.testing.assert_close(kv_quant.dequantize(v_cache.view(-1, 3, 68)[slots], torch.float32), value,
                               atol=0.02, rtol=0.02)


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 700])  # 700 x 3 rows: written by both threads
def test_c_write_kv_stores_the_bytes_of_kv_quant(path, dtype, tokens):
    """The C quantize-on-write gives the reference's bytes exactly, from rows of every size (an
    all-zero one among them), read from a view of a fused projection as the model hands them."""
    g = torch.Generator().manual_seed(tokens)
    fused = torch.randn(tokens, 3 * 3 * 64, generator=g) * torch.logspace(-4, 3, tokens)[:, None]
    fused[1, 3 * 64:] = 0.0
    # a row whose values fall halfway between integers once scaled (max 127: scale 1), rounded half to even
    fused[2, 3 * 64:4 * 64] = torch.cat([torch.tensor([127.0, -126.5]), torch.arange(-31, 31) + 0.5])
    fused = fused.to(dtype)
    key = fused[:, 3 * 64:6 * 64].view(tokens, 3, 64)  # strided: not contiguous
    value = fused[:, 6 * 64:].view(tokens, 3, 64)
    slots = torch.randperm(64 * 16, generator=g)[:tokens]
    caches = [torch.randint(0, 256, (64, 16, 3, 68), dtype=torch.uint8, generator=g) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.write_kv(key, value, *want, slots)
    KERNELS[path].write_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    with pytest.raises(IndexError):
        KERNELS[path].write_kv(key, value, *caches, torch.full_like(slots, 64 * 16))


@needs_c
def test_c_write_kv_leaves_other_caches_to_the_reference():
    key, value = torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    caches = [torch.zeros(2, 16, 3, 64) for _ in range(2)]
    KERNEL.write_kv(key, value, *caches, torch.tensor([0, 5, 17, 31]))
    assert torch.equal(caches[0].view(-1, 3, 64)[[0, 5, 17, 31]], key)
    assert torch.equal(caches[1].view(-1, 3, 64)[[0, 5, 17, 31]], value)


def quantized_case(lens, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    q, k, v, tables, lens, scale = paged_case(lens, block_size, heads, kv_heads, head_dim, torch.float32, seed)
    return q.to(dtype), kv_quant.quantize(k), kv_quant.quantize(v), tables, lens, scale


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (16, 9, 3, 64), (24, 16, 2, 64), (16, 8, 2, 128)])  # 128: the plain C loop
def test_int8_cache_decode_matches_reference(path, dtype, block_size, heads, kv_heads, head_dim):
    args = quantized_case(WINDOW_LENS, block_size, heads, kv_heads, head_dim, dtype, seed=block_size)
    for window in (None, 20, 130):
        got = KERNELS[path].paged_decode_attention(*args, window=window)
        want = reference.paged_decode_attention(*args, window=window)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_int8_cache_attention_is_close_to_float32():
    """What int8 costs in accuracy, on random rows: the attention output within a few hundredths."""
    q, k, v, tables, lens, scale = paged_case([40, 300, 1000], 16, 9, 3, 64, torch.float32, seed=13)
    exact = reference.paged_decode_attention(q, k, v, tables, lens, scale)
    got = reference.paged_decode_attention(q, kv_quant.quantize(k), kv_quant.quantize(v), tables, lens, scale)
    assert 0 < (got - exact).abs().max() < 0.03


@pytest.mark.parametrize("reads_own_rows", [True, False])
def test_the_model_hands_prefill_its_chunks_rows_only_where_the_backend_reads_them(tiny_loaded, reads_own_rows):
    """The chunks' own keys and values go to ``prefill`` where the ops say it reads them (the reference);
    the Triton and C kernels read the cache, so they are not handed rows they would not read."""
    import dataclasses

    from worker.engine.engine import Engine
    from worker.engine.request import SamplingParams

    engine = Engine(loaded=tiny_loaded, kv_memory="8MiB", attention_backend="torch")
    model = engine.runner.model
    given = []

    def prefill(*args, **kwargs):
        given.append(sorted(kwargs))
        return reference.paged_prefill_attention(*args, **kwargs)

    model.ops = dataclasses.replace(model.ops, prefill=prefill, prefill_reads_own_rows=reads_own_rows)
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].completions[0].token_ids) == 3 and given
    assert all(kw == (["key", "value"] if reads_own_rows else []) for kw in given)


# --------------------------------------------------------------------------------------------------
# prefill (berth_paged_prefill): chunks of queries over the cache, which holds the chunks' own rows
# --------------------------------------------------------------------------------------------------

# (cached tokens before the chunk, chunk length): whole prompts (no prior context) of the default model's
# length and of one token, chunks after a prior context at unaligned offsets, single tokens, an empty
# chunk, and a chunk whose keys span the kernel's key chunks (256) and whose rows span several tasks
PREFILL_BATCH = [(0, 136), (0, 1), (105, 45), (36, 1), (20, 0), (64, 32), (150, 90), (0, 17), (300, 280), (3, 5)]
PREFILL_WINDOWS = [None, 1, 20, 130, 5000]


def prefill_case(batch, block_size, heads, kv_heads, head_dim, dtype, kv_dtype=None, seed=0):
    """Queries ``[sum of chunks, heads, head_dim]`` in ``dtype`` and caches in ``dtype`` or, with
    ``kv_dtype="int8"``, int8 rows, holding every sequence's context and chunk."""
    _, k, v, tables, lens, scale = paged_case([c + n for c, n in batch], block_size, heads, kv_heads, head_dim,
                                              torch.float32, seed)
    k, v = (kv_quant.quantize(k), kv_quant.quantize(v)) if kv_dtype == "int8" else (k.to(dtype), v.to(dtype))
    chunks = [n for _, n in batch]
    starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)
    q = torch.randn(sum(chunks), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k, v, tables, starts, lens, scale


def c_prefill(path, monkeypatch, *args, **kwargs):
    """The C kernel's prefill, failing where it would hand the case to the reference."""
    def no_fallback(*_, **__):
        raise AssertionError("the C prefill fell back to the reference")

    with monkeypatch.context() as m:
        m.setattr(reference, "paged_prefill_attention", no_fallback)
        return KERNELS[path].paged_prefill_attention(*args, **kwargs)


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (16, 9, 3, 64), (16, 4, 4, 64), (32, 16, 4, 64), (24, 8, 2, 64),  # groups 3, 1, 4, 4; 24: unaligned blocks
    (16, 8, 2, 128), (8, 6, 2, 48)])  # other head sizes: two passes of values, a partial one
def test_prefill_matches_reference(path, dtype, kv_dtype, block_size, heads, kv_heads, head_dim, monkeypatch):
    args = prefill_case(PREFILL_BATCH, block_size, heads, kv_heads, head_dim, dtype, kv_dtype, seed=block_size)
    for window in PREFILL_WINDOWS:
        want = reference.paged_prefill_attention(*args, window=window)
        got = c_prefill(path, monkeypatch, *args, window=window)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_c
@each_path
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_prefill_ignores_the_own_rows_it_is_handed(path, kv_dtype, monkeypatch):
    """Handed the chunks' own keys and values (as the model hands the reference them: for an int8 cache,
    rounded as the cache holds them), the kernel reads the same rows from the cache: the reference's
    output with them, within float tolerance."""
    q, k, v, tables, starts, lens, scale = prefill_case(PREFILL_BATCH, 16, 9, 3, 64, torch.float32, kv_dtype, seed=4)
    slots = chunk_slots(tables, PREFILL_BATCH)
    key, value = (kv_quant.as_values(c.flatten(0, 1)[slots], torch.float32) for c in (k, v))
    for window in (None, 20):
        want = reference.paged_prefill_attention(q, k, v, tables, starts, lens, scale, window, key, value)
        got = c_prefill(path, monkeypatch, q, k, v, tables, starts, lens, scale, window, key, value)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_c
@each_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_of_few_long_chunks_split_over_threads_matches_reference(path, dtype, threads, monkeypatch):
    """A long chunk after a long context and a short one: the long one's tokens are cut into blocks
    (tasks) by the thread count, their keys into several chunks whose softmax states carry over, and a
    window leaves a block's first rows keys its last rows no longer see."""
    batch = [(600, 1000), (0, 3)]
    args = prefill_case(batch, 16, 9, 3, 64, dtype, seed=6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 100, 700):
            want = reference.paged_prefill_attention(*args, window=window)
            got = c_prefill(path, monkeypatch, *args, window=window)
            torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    finally:
        torch.set_num_threads(before)


@needs_c
def test_prefill_the_kernel_cannot_run_falls_back_to_reference():
    """float16 queries, and a head size that is no multiple of the vector's lanes: the reference's output."""
    for dtype, head_dim in ((torch.float16, 64), (torch.float32, 36)):
        args = prefill_case([(0, 20), (7, 9)], 16, 4, 2, head_dim, dtype, seed=2)
        torch.testing.assert_close(KERNEL.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


@needs_c
def test_cpu_backend_prefills_with_the_c_kernel_over_the_cache():
    ops = select_ops("cpu", "cpu", cache_dir("kernels"))
    assert ops.prefill == KERNEL.paged_prefill_attention and not ops.prefill_reads_own_rows
    assert select_ops("torch", "cpu", cache_dir("kernels")).prefill_reads_own_rows
