"""Triton kernels for paged attention: the engine's CUDA path, with the signatures and semantics of
``kernels.reference`` (see its docstring for the KV-cache layout).

Design
------
An attention program owns one kv head of one sequence together with every query row that reads
it: the ``queries_per_kv`` query heads of ``BLOCK_Q`` consecutive query tokens, laid out as row
``token * GROUP_PAD + head_in_group`` of a ``[BLOCK_Q * GROUP_PAD, head_dim]`` tile. K and V are
thus read once per group, and both matrix products run through ``tl.dot`` (which needs at least 16
rows, hence the padding). The program walks the sequence's cached tokens in tiles of ``KV_TILE``
tokens, a tile spanning one or more ``block_size`` pages whose ids come from the block table, and
keeps an online softmax in float32 (base 2).

- ``paged_decode_attention``: ``BLOCK_Q = 1``, grid ``(num_seqs, num_kv_heads, num_splits)``. With
  several splits (flash decoding, for few sequences with long contexts) each program covers a
  contiguous share of the sequence's KV tiles and writes a partial result with its log-sum-exp;
  ``_combine_splits_kernel`` merges them, one program per (sequence, query head).
- ``paged_prefill_attention``: grid ``(query tiles, num_kv_heads)``. The query tiles of all
  sequences are numbered without reading ``query_start_loc`` on the host: sequence s's tiles start
  at ``query_start_loc[s] // BLOCK_Q + s``, so ``total_tokens // BLOCK_Q + num_seqs`` programs always
  suffice; each finds its sequence by binary search and exits if its tile is past the chunk's end.
- ``write_kv``: one program per token, storing all its kv heads.
- A sliding ``window`` (``HAS_WINDOW``, a compile-time switch, so full attention compiles as
  before): a program's loop starts at the KV tile holding the first key its first query row sees,
  so the tiles wholly before the window are never loaded; within the tiles it does load, each row
  masks the keys before its own window.
- A quantized cache (``kernels.kv_quant``: int8 or fp8_e4m3 rows of ``head_dim`` values and their
  float32 scale; ``QUANTIZED``, a compile-time switch) is read and written in place. The kernels
  see a row's bytes through two views of the same memory (``_kv_operands``): the values through the
  cache as int8 or float8_e4m3fn, the scale through the cache as float32, whose element
  ``(row offset + head_dim) // 4`` it is (a row is ``head_dim + 4`` bytes, a multiple of 4, so
  every scale is 4-byte aligned). That is one aligned load per row, which the interpreter runs as
  well; a pointer cast or 4 byte loads bitcast together would do the same in more steps.
  Attention loads a tile's values and scales and dequantises them in registers to the query's
  dtype, as the reference does (int8 and e4m3 values are exact in bfloat16 and float16);
  ``write_kv`` quantizes each (token, kv head) row as ``kv_quant.quantize`` does, with correctly
  rounded divisions and rounding ties to even, so on the interpreter its bytes equal the
  reference's (on a GPU, PyTorch divides by a constant through its reciprocal: a scale may differ
  in its last bit).

The wrappers read only tensor shapes, never tensor values, so they do not synchronize with the
device. They run on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_quant

KV_TILE = 64
"""Cached tokens per iteration of the attention loop (raised to the block size if that is larger)."""
PREFILL_ROWS = 64
"""Query rows (tokens x heads of a group) per prefill program; groups larger than this get one token."""
MIN_TOKENS_PER_SPLIT = 512
"""Decode splits a sequence's context only into shares at least this long."""
MAX_SPLITS = 32
"""Most splits the default heuristic picks per sequence."""
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Device helpers shared by the kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _query_rows(first_token, end_token, kv_head, QUERIES_PER_KV: tl.constexpr,
                GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Rows of a query tile: ``BLOCK_Q`` tokens from ``first_token`` x the query heads of ``kv_head``.

    Returns ``(tokens, heads, valid)``, each ``[BLOCK_Q * GROUP_PAD]``; a row is valid when its token
    is below ``end_token`` and its head is one of the group's ``QUERIES_PER_KV`` (not padding).
    """
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = first_token + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    heads = kv_head * QUERIES_PER_KV + in_group
    valid = (tokens < end_token) & (in_group < QUERIES_PER_KV)
    return tokens, heads, valid


@triton.jit
def _row_offsets(tokens, heads, stride_token, stride_head, HEAD_DIM: tl.constexpr):
    """Offsets ``[rows, HEAD_DIM]`` of ``x[tokens[r], heads[r], :]`` in ``x``: ``[tokens, heads, HEAD_DIM]``.

    ``tokens`` may be a scalar, shared by every row.
    """
    rows = tokens.to(tl.int64) * stride_token + heads * stride_head
    return rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _cache_offset(block_id, offset_in_block, kv_head, stride_block, stride_slot, stride_head):
    """Element offset (int64) of ``cache[block_id, offset_in_block, kv_head, 0]``."""
    return block_id.to(tl.int64) * stride_block + offset_in_block * stride_slot + kv_head * stride_head


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first tile, ``query_start_loc[s] // BLOCK_Q + s``, is ``<= tile``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        starts_before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(starts_before, mid + 1, lo)
        hi = tl.where(starts_before, hi, mid)
    return lo - 1


@triton.jit
def _load_rows(cache_ptr, scale_ptr, rows, in_range, HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):
    """``[len(rows), HEAD_DIM]`` values of the cache rows at element offsets ``rows`` (zeros where not
    ``in_range``): as stored, or dequantised to float32 with ``QUANTIZED``."""
    x = tl.load(cache_ptr + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], mask=in_range[:, None], other=0.0)
    if QUANTIZED:
        scale = tl.load(scale_ptr + (rows + HEAD_DIM) // 4, mask=in_range, other=0.0)
        x = x.to(tl.float32) * scale[:, None]
    return x


@triton.jit
def _store_rows(cache_ptr, scale_ptr, rows, x, mask, HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr,
                VALUE_MAX: tl.constexpr, IS_FP8: tl.constexpr):
    """Store ``x`` ``[len(rows), HEAD_DIM]`` at the cache rows at element offsets ``rows`` where ``mask``:
    as is, or with ``QUANTIZED`` as ``kv_quant.quantize`` does (scale ``max|row| / VALUE_MAX``)."""
    offsets = rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    if QUANTIZED:
        x = x.to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 1), VALUE_MAX), 1e-30)
        x = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -VALUE_MAX), VALUE_MAX)
        if IS_FP8:
            x = _round_to_e4m3(x)
        else:
            x = _round_half_even(x)
        tl.store(scale_ptr + (rows + HEAD_DIM) // 4, scale, mask=mask)
    tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask[:, None])


@triton.jit
def _round_half_even(x):
    """``x`` (float32) to the nearest integer, ties to even, as ``torch.round``."""
    below = tl.floor(x)
    fraction = x - below  # exact
    odd = below - 2.0 * tl.floor(below * 0.5) == 1.0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), below + 1.0, below)


@triton.jit
def _round_to_e4m3(x):
    """``x`` (float32, ``|x| <= 448``) to the nearest float8_e4m3fn value, ties to even, still float32.

    Its conversion to fp8 is then exact. (The GPU's conversion would round the same way, but the
    interpreter's drops the carry of a mantissa that rounds up: 7.76 became 4.) e4m3 keeps 3
    mantissa bits: a value of exponent e (from -6 down, the subnormals, the step is 2^-9) lies on a
    grid of 2^(e-3), whose powers of two are built from their exponent bits, so scaling is exact. The
    magnitude is rounded and the sign bit put back, so a negative value that rounds to zero is -0,
    as PyTorch stores it.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)
    magnitude = _round_half_even(tl.abs(x) * inverse) * step
    return tl.where(bits < 0, -magnitude, magnitude)


@triton.jit
def _first_tile(first_pos, window, TILE: tl.constexpr):
    """The start of the KV tile holding the first key that a query at ``first_pos`` sees in its window."""
    return tl.maximum(first_pos - window + 1, 0) // TILE * TILE


@triton.jit
def _attend(q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr,
            kv_head, qk_scale, window, stride_cache_block, stride_cache_slot, stride_cache_head,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
            DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr):
    """Online softmax of the rows of ``q`` over one sequence's cached positions ``[kv_start, kv_end)``.

    ``q``: ``[M, HEAD_DIM]``; row r sees positions ``<= q_pos[r]`` (and, with ``HAS_WINDOW``, only those
    ``> q_pos[r] - window``). ``block_table_ptr`` points at the sequence's row of the block table;
    ``qk_scale`` is the softmax scale times log2(e). With ``QUANTIZED``, ``k_scale_ptr`` and
    ``v_scale_ptr`` are the caches as float32 (see the module docstring).
    Returns ``(acc, row_max, row_sum)``: the unnormalised output ``[M, HEAD_DIM]`` and the running max
    and sum ``[M]`` (base 2), all float32. An empty range gives zeros and a max of -inf. Without a
    window each row must see a position of the first tile, else its max is still -inf at the second
    tile and it gets NaN; with one, a row's window may begin tiles after another's, so a row that has
    seen nothing yet exponentiates against 0 instead of its max of -inf.
    """
    acc = tl.zeros([q.shape[0], HEAD_DIM], tl.float32)
    row_max = tl.full([q.shape[0]], float("-inf"), tl.float32)
    row_sum = tl.zeros([q.shape[0]], tl.float32)
    for tile_start in range(kv_start, kv_end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        in_range = pos < kv_end
        block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
        rows = _cache_offset(block_ids, pos % BLOCK_SIZE, kv_head, stride_cache_block, stride_cache_slot,
                             stride_cache_head)
        k = _load_rows(k_cache_ptr, k_scale_ptr, rows, in_range, HEAD_DIM, QUANTIZED).to(q.dtype)
        v = _load_rows(v_cache_ptr, v_scale_ptr, rows, in_range, HEAD_DIM, QUANTIZED).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        shift = new_max
        if HAS_WINDOW:  # a row that has seen no key yet: every p and the correction are 0, not NaN
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - shift)
        p = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v, acc * correction[:, None], input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                     num_kv_heads, stride_key_token, stride_key_head, stride_value_token, stride_value_head,
                     stride_cache_block, stride_cache_slot, stride_cache_head,
                     HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     QUANTIZED: tl.constexpr, VALUE_MAX: tl.constexpr, IS_FP8: tl.constexpr):
    """Program t copies token t's key and value, all kv heads, into cache slot ``slot_mapping[t]``
    (each (token, kv head) row quantized with its own scale, with ``QUANTIZED``)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    mask = heads < num_kv_heads
    slot = tl.load(slot_mapping_ptr + token)
    rows = _cache_offset(slot // BLOCK_SIZE, slot % BLOCK_SIZE, heads, stride_cache_block, stride_cache_slot,
                         stride_cache_head)
    key = tl.load(key_ptr + _row_offsets(token, heads, stride_key_token, stride_key_head, HEAD_DIM),
                  mask=mask[:, None], other=0.0)
    value = tl.load(value_ptr + _row_offsets(token, heads, stride_value_token, stride_value_head, HEAD_DIM),
                    mask=mask[:, None], other=0.0)
    _store_rows(k_cache_ptr, k_scale_ptr, rows, key, mask, HEAD_DIM, QUANTIZED, VALUE_MAX, IS_FP8)
    _store_rows(v_cache_ptr, v_scale_ptr, rows, value, mask, HEAD_DIM, QUANTIZED, VALUE_MAX, IS_FP8)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
                   out_ptr,
                   partial_out_ptr, partial_lse_ptr, qk_scale, num_heads, window,
                   stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
                   stride_cache_block, stride_cache_slot, stride_cache_head,
                   QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   QUANTIZED: tl.constexpr):
    """Program (s, g, i): the query heads of kv head g of sequence s over split i of its context (of
    its window's tiles, with ``HAS_WINDOW``).

    With one split it writes the output. Otherwise it writes head h's normalised output and its
    log2-sum-exp (-inf for an empty split) to row ``(s * num_heads + h) * NUM_SPLITS + i`` of
    ``partial_out`` ``[rows, HEAD_DIM]`` and ``partial_lse`` ``[rows]``.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    tokens, heads, valid = _query_rows(seq, seq + 1, kv_head, QUERIES_PER_KV, GROUP_PAD, 1)
    q = tl.load(q_ptr + _row_offsets(tokens, heads, stride_q_token, stride_q_head, HEAD_DIM), mask=valid[:, None],
                other=0.0).to(DOT_DTYPE)
    kv_first = 0
    if HAS_WINDOW:
        kv_first = _first_tile(context_len - 1, window, TILE)
    tiles_per_split = tl.cdiv(tl.cdiv(context_len - kv_first, TILE), NUM_SPLITS)
    kv_start = kv_first + split * tiles_per_split * TILE
    kv_end = tl.minimum(kv_start + tiles_per_split * TILE, context_len)
    q_pos = tl.full([GROUP_PAD], 0, tl.int32) + context_len - 1
    acc, row_max, row_sum = _attend(
        q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_block_table, kv_head, qk_scale, window,
        stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM, BLOCK_SIZE, TILE, DOT_PRECISION,
        HAS_WINDOW, QUANTIZED)
    if NUM_SPLITS == 1:
        out = acc / row_sum[:, None]
        tl.store(out_ptr + _row_offsets(tokens, heads, stride_out_token, stride_out_head, HEAD_DIM),
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        partial_rows = (tokens.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        row_sum = tl.where(row_sum > 0, row_sum, 1.0)  # an empty split: acc is 0 and row_max -inf
        tl.store(partial_out_ptr + partial_rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                 acc / row_sum[:, None], mask=valid[:, None])
        tl.store(partial_lse_ptr + partial_rows, row_max + tl.log2(row_sum), mask=valid)


@triton.jit
def _combine_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, num_heads, stride_out_token,
                           stride_out_head, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr):
    """Program r = s * num_heads + h merges the splits of head h of sequence s (rows ``r * NUM_SPLITS``
    onwards of the partial buffers) into ``out``."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    used = splits < NUM_SPLITS
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits, mask=used, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=used[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    seq = row // num_heads
    head = row % num_heads
    tl.store(out_ptr + seq * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    query_start_loc_ptr, context_lens_ptr, out_ptr, qk_scale, num_seqs, window,
                    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_block_table,
                    stride_cache_block, stride_cache_slot, stride_cache_head,
                    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    QUANTIZED: tl.constexpr):
    """Program (t, g): ``BLOCK_Q`` query tokens of one sequence x the query heads of kv head g.

    Sequence s owns tiles ``query_start_loc[s] // BLOCK_Q + s`` onwards (see the module docstring);
    a tile past the end of its sequence's chunk does nothing.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    first_token = q_begin + (tile - q_begin // BLOCK_Q - seq) * BLOCK_Q
    if first_token < q_end:
        context_len = tl.load(context_lens_ptr + seq)
        chunk_start_pos = context_len - (q_end - q_begin)
        tokens, heads, valid = _query_rows(first_token, q_end, kv_head, QUERIES_PER_KV, GROUP_PAD, BLOCK_Q)
        q = tl.load(q_ptr + _row_offsets(tokens, heads, stride_q_token, stride_q_head, HEAD_DIM),
                    mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        q_pos = chunk_start_pos + tokens - q_begin
        kv_end = tl.minimum(chunk_start_pos + first_token + BLOCK_Q - q_begin, context_len)
        kv_first = 0
        if HAS_WINDOW:
            kv_first = _first_tile(chunk_start_pos + first_token - q_begin, window, TILE)
        acc, row_max, row_sum = _attend(
            q, q_pos, kv_first, kv_end, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            block_tables_ptr + seq.to(tl.int64) * stride_block_table, kv_head, qk_scale, window,
            stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM, BLOCK_SIZE, TILE, DOT_PRECISION,
            HAS_WINDOW, QUANTIZED)
        if HAS_WINDOW:  # rows past the chunk's end (never stored) may see no key: 0 / 0
            row_sum = tl.where(row_sum > 0, row_sum, 1.0)
        out = acc / row_sum[:, None]
        tl.store(out_ptr + _row_offsets(tokens, heads, stride_out_token, stride_out_head, HEAD_DIM),
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


# --------------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------------

def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[tokens, num_kv_heads, head_dim]`` into their slots, in place
    (quantized, each (token, kv head) row with its scale, into an int8 or fp8 cache)."""
    _check_caches(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape[2] == num_kv_heads and _head_dim(k_cache) == head_dim, \
        f"key {tuple(key.shape)}, value {tuple(value.shape)} do not fit a cache of {tuple(k_cache.shape)}"
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    fmt = kv_quant.row_format(k_cache)
    _write_kv_kernel[(num_tokens,)](
        key, value, *_kv_operands(k_cache, v_cache), slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *k_cache.stride()[:3],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        QUANTIZED=fmt is not None, VALUE_MAX=fmt.max_value if fmt else 0.0,
        IS_FP8=fmt is not None and fmt.value_dtype != torch.int8)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, *, num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence. ``q``: ``[num_seqs, num_heads, head_dim]`` -> same shape.

    The query of sequence s sits at position ``context_lens[s] - 1`` and sees every cached token, or
    with a ``window`` the last ``window`` of them.
    ``num_splits`` is how many programs share each sequence's context (its window's tiles, with one)
    for flash decoding; by default it is picked from the shapes and the device's multiprocessor count.
    """
    _check_caches(k_cache, v_cache)
    _check_window(window)
    num_seqs, num_heads, head_dim = q.shape
    group = _query_group(q, k_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    block_size = k_cache.shape[1]
    tile = max(KV_TILE, block_size)
    if num_splits is None:
        longest = block_tables.shape[1] * block_size
        if window is not None:  # the window's tiles, from the one that holds its first key
            longest = min(longest, window + tile)
        num_splits = default_num_splits(num_seqs * k_cache.shape[2], longest, q.device)
    assert num_splits >= 1, f"num_splits must be at least 1, got {num_splits}"
    partial_out = partial_lse = out  # unused with one split
    if num_splits > 1:
        partial_out = torch.empty((num_seqs * num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((num_seqs * num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, *_kv_operands(k_cache, v_cache), block_tables, context_lens, out, partial_out, partial_lse,
        scale * _LOG2E, num_heads, window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *k_cache.stride()[:3], QUERIES_PER_KV=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=tile,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, QUANTIZED=kv_quant.is_quantized(k_cache),
        **_dot_operands(q))
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs * num_heads,)](
            partial_out, partial_lse, out, num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """A chunk of queries per sequence, attending causally to the cache (which holds the chunk). Every
    position is read from the cache: the model hands it no chunk's own rows (``prefill_reads_own_rows``).

    ``q``: ``[total_query_tokens, num_heads, head_dim]``, sequence s owning rows
    ``query_start_loc[s]:query_start_loc[s+1]``; its query i sits at position
    ``context_lens[s] - q_len_s + i`` and sees cached positions up to and including its own (with a
    ``window``, only the last ``window`` of those).
    """
    _check_caches(k_cache, v_cache)
    _check_window(window)
    total_tokens, num_heads, head_dim = q.shape
    group = _query_group(q, k_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if total_tokens == 0 or num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, PREFILL_ROWS // group_pad)
    block_size = k_cache.shape[1]
    _prefill_kernel[(total_tokens // block_q + num_seqs, k_cache.shape[2])](
        q, *_kv_operands(k_cache, v_cache), block_tables, query_start_loc, context_lens, out, scale * _LOG2E,
        num_seqs, window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *k_cache.stride()[:3], QUERIES_PER_KV=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=max(KV_TILE, block_size), HAS_WINDOW=window is not None,
        QUANTIZED=kv_quant.is_quantized(k_cache), **_dot_operands(q))
    return out


# --------------------------------------------------------------------------------------------------
# Host-side helpers (shapes only)
# --------------------------------------------------------------------------------------------------

def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Assert the cache layout the kernels support: equal K/V layouts, power-of-two sizes >= 16."""
    assert k_cache.dim() == 4, \
        f"caches are [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() \
        and k_cache.dtype == v_cache.dtype, "k_cache and v_cache must have the same shape, strides and dtype"
    assert k_cache.stride(3) == 1, "the caches' head_dim must be contiguous"
    block_size, head_dim = k_cache.shape[1], _head_dim(k_cache)
    assert _is_power_of_two_at_least_16(head_dim), \
        f"the Triton kernels need a power-of-two head_dim >= 16 (e.g. 64 or 128), got {head_dim}"
    assert _is_power_of_two_at_least_16(block_size), \
        f"the Triton kernels need a power-of-two block_size >= 16 (e.g. 16 or 32), got {block_size}"


def _head_dim(cache: torch.Tensor) -> int:
    """Values per (token, kv head) row: a quantized row holds its scale's 4 bytes after them."""
    return cache.shape[3] - kv_quant.SCALE_BYTES if kv_quant.is_quantized(cache) else cache.shape[3]


def _kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' cache arguments ``(k values, v values, k scales, v scales)``.

    A quantized cache is passed as two views of its memory (see the module docstring): its values as
    int8 (the int8 format's ``uint8`` cache viewed as int8) or float8_e4m3fn, and the same bytes as
    float32 for the scales (``view`` checks that every row and the start are 4-byte aligned). A plain
    cache is passed as is, twice: the kernels compiled without ``QUANTIZED`` never read the scales.
    """
    fmt = kv_quant.row_format(k_cache)
    if fmt is None:
        return k_cache, v_cache, k_cache, v_cache
    return (k_cache.view(fmt.value_dtype), v_cache.view(fmt.value_dtype),
            k_cache.view(torch.float32), v_cache.view(torch.float32))


def _check_window(window: int | None) -> None:
    assert window is None or (isinstance(window, int) and window > 0), \
        f"a sliding window is a positive number of tokens or None, got {window!r}"


def _query_group(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Query heads per kv head, checking that ``q`` fits the cache."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert head_dim == _head_dim(k_cache), f"q head_dim {head_dim} != cache head_dim {_head_dim(k_cache)}"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    return num_heads // num_kv_heads


def _is_power_of_two_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _dot_operands(q: torch.Tensor) -> dict:
    """``DOT_DTYPE`` and ``DOT_PRECISION`` of the attention kernels' matrix products.

    The operands keep the input's dtype, except that the interpreter (tensors off CUDA) cannot
    multiply bfloat16 and gets float32. Float32 products are exact ("ieee"): TF32 would miss the
    reference by ~1e-3.
    """
    assert q.dtype in _TL_DTYPES, f"the Triton kernels take float32, bfloat16 or float16, got {q.dtype}"
    dtype = _TL_DTYPES[q.dtype]
    if dtype == tl.bfloat16 and q.device.type != "cuda":
        dtype = tl.float32
    return {"DOT_DTYPE": dtype, "DOT_PRECISION": "ieee" if dtype == tl.float32 else "tf32"}


def default_num_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence so that decode fills the GPU: about two programs per multiprocessor.

    ``programs`` is the count without splitting (sequences x kv heads) and ``max_context`` the longest
    context the block tables allow; each split gets at least ``MIN_TOKENS_PER_SPLIT`` of it. Off CUDA
    (the interpreter) there is nothing to fill, so one split.
    """
    if device.type != "cuda":
        return 1
    slots = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, slots // programs, max_context // MIN_TOKENS_PER_SPLIT))
