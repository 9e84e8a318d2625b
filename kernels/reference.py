"""PyTorch implementations of the paged-attention operations: the engine's CPU path and the
reference the Triton kernels are tested against.

Layout shared by every implementation:
- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one pair per layer.
- A token's slot is ``block_id * block_size + offset``; ``slot_mapping[t]`` says where token t goes.
- ``block_tables``: ``[num_seqs, max_blocks]`` int32; row s lists sequence s's blocks in order,
  padded with any valid block id (padding is never read past ``context_lens[s]``).
- ``context_lens``: ``[num_seqs]`` int32, tokens in the cache for the sequence *including* the ones
  being computed in this step (their K/V are written before attention runs).
- Grouped-query attention: query head h reads kv head ``h // (num_heads // num_kv_heads)``.
- A quantized cache (``kernels.kv_quant``: int8 rows in a ``uint8`` tensor, fp8 rows in a
  ``float8_e4m3fn`` one) has rows of ``head_dim + 4`` bytes (values and their scale): it is written
  quantized and read back as values in the query's dtype.
- ``window``: ``None`` for full causal attention; else a sliding window as transformers'
  (``masking_utils.sliding_window_causal_mask_function``): the query at position p sees the keys at
  positions k with ``p - window < k <= p``, its own and the ``window - 1`` before it. The blocks
  wholly before a window are not read; they stay allocated (the block manager frees a sequence's
  blocks only when it ends, where vLLM frees those a window has left).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import kv_quant


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value`` ``[tokens, num_kv_heads, head_dim]`` into their slots (quantized
    into an int8 or fp8 cache)."""
    kv_heads, row = k_cache.shape[2], k_cache.shape[3]
    fmt = kv_quant.row_format(k_cache)
    if fmt is not None:  # copied as bytes: the CPU has no index_copy_ of float8
        key = kv_quant.quantize(key, fmt.name).view(torch.uint8)
        value = kv_quant.quantize(value, fmt.name).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, row).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


DECODE_GROUP = 32
"""Decode sequences are sorted by length and attended in groups of this many, each padded only to
the longest of its group, so a batch mixing short and long contexts gathers little padding."""


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[..., max_blocks]`` block ids -> ``[..., num_kv_heads, max_blocks * block_size, head_dim]``."""
    *lead, nb = block_table.shape
    rows = cache.view(torch.uint8) if kv_quant.is_quantized(cache) else cache  # PyTorch has few float8 kernels
    blocks = rows.index_select(0, block_table.reshape(-1).long()).view(cache.dtype)  # one indexing op, no padding
    bs, kvh, d = cache.shape[1:]
    return blocks.view(*lead, nb * bs, kvh, d).transpose(-3, -2)


def _prior_and_chunk(k_cache, v_cache, table, prior: int, key: torch.Tensor, value: torch.Tensor, dtype):
    """``[kvh, prior + q_len, d]`` keys and values: the ``prior`` positions read from the cache blocks
    ``table`` lists, then the chunk's own (``key``, ``value``: ``[q_len, kvh, d]``)."""
    k, v = key.transpose(0, 1), value.transpose(0, 1)
    if prior == 0:
        return k, v
    blocks = table[:-(-prior // k_cache.shape[1])]
    return tuple(torch.cat([kv_quant.as_values(_gather(cache, blocks)[:, :prior], dtype), own], dim=1)
                 for cache, own in ((k_cache, k), (v_cache, v)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int | None = None) -> torch.Tensor:
    """One query token per sequence. ``q``: ``[num_seqs, num_heads, head_dim]`` -> same shape.

    The query of sequence s sits at position ``context_lens[s] - 1`` and sees every cached token,
    or with a ``window`` the last ``window`` of them.
    """
    num_seqs = q.shape[0]
    block_size = k_cache.shape[1]
    if window is not None:
        block_tables, context_lens = _window_tables(block_tables, context_lens, window, block_size)
    if num_seqs <= DECODE_GROUP:
        return _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    order = torch.argsort(context_lens)
    lens = context_lens[order].tolist()
    out = torch.empty_like(q)
    for start in range(0, num_seqs, DECODE_GROUP):
        idx = order[start:start + DECODE_GROUP]
        width = -(-lens[min(start + DECODE_GROUP, num_seqs) - 1] // block_size)
        out[idx] = _decode_padded(q[idx], k_cache, v_cache, block_tables[idx, :width], context_lens[idx], scale,
                                  window)
    return out


def _window_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode sequence seen from the block that holds the first key of its window: the block
    tables shifted left by the blocks before it (``ceil(window / block_size) + 1`` columns at most)
    and the context lengths counted from there. One gather for the batch, not a loop."""
    width = -(-window // block_size) + 1
    if width >= block_tables.shape[1]:
        return block_tables, context_lens
    first = (context_lens.long() - window).clamp(min=0) // block_size  # [num_seqs]
    # Columns past a sequence's last block read the table's last column (any valid id): masked.
    columns = (first[:, None] + torch.arange(width, device=first.device)).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, columns), context_lens - (first * block_size).to(context_lens.dtype)


def _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, window=None):
    """The query heads sharing a kv head attend as one group of rows: K and V are never repeated."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k = kv_quant.as_values(_gather(k_cache, block_tables), q.dtype)  # [B, kvh, L, d]
    v = kv_quant.as_values(_gather(v_cache, block_tables), q.dtype)
    length = k.shape[-2]
    key_pos = torch.arange(length, device=q.device)[None, :]
    lens = context_lens[:, None].to(torch.long)
    valid = key_pos < lens
    if window is not None:
        valid &= key_pos >= lens - window
    grouped = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.view(num_seqs, num_heads, head_dim)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, window: int | None = None,
                            key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of queries per sequence, attending causally to the cache (which holds the chunk).

    ``q``: ``[total_query_tokens, num_heads, head_dim]``, sequence s owning rows
    ``query_start_loc[s]:query_start_loc[s+1]``; its query i sits at position
    ``context_lens[s] - q_len_s + i`` and sees cached positions up to and including its own (with a
    ``window``, only the last ``window`` of those).

    ``key``, ``value``: the chunks' own keys and values, ``[total_query_tokens, num_kv_heads, head_dim]``
    in ``q``'s dtype, equal to what this step wrote to the cache. Where given, a chunk reads its own
    positions from them and only the positions before it from the cache: a whole prompt in one chunk
    (the usual case) gathers nothing. For a quantized cache they are the rows rounded as the cache holds
    them (``kv_quant.dequantize(kv_quant.quantize(rows))``): a chunk sees its rows as a decode step and
    a resumed run see them.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    block_size = k_cache.shape[1]
    for s, ctx in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        windowed = window is not None and ctx > window
        # From the block of the first key the chunk's first query sees: positions count from there.
        first = max(0, ctx - q_len - window + 1) // block_size if windowed else 0
        table = block_tables[s, first: (ctx + block_size - 1) // block_size]
        ctx -= first * block_size
        if key is None:
            k = kv_quant.as_values(_gather(k_cache, table)[:, :ctx], q.dtype)  # [kvh, ctx, d]
            v = kv_quant.as_values(_gather(v_cache, table)[:, :ctx], q.dtype)
        else:
            k, v = _prior_and_chunk(k_cache, v_cache, table, ctx - q_len, key[lo:hi], value[lo:hi], q.dtype)
        # Each kv head repeated for its query heads, in 4-D: PyTorch's CPU flash kernel takes that
        # shape, while 3-D or enable_gqa falls back to the unfused math path (2-3 times slower).
        group = q.shape[1] // k.shape[0]
        k = k.repeat_interleave(group, dim=0)[None]
        v = v.repeat_interleave(group, dim=0)[None]
        qs = q[lo:hi].transpose(0, 1)[None]  # [1, h, q_len, d]
        if q_len == ctx and not windowed:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:
            pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
            key_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = key_pos <= pos
            if windowed:
                mask &= key_pos > pos - window
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
