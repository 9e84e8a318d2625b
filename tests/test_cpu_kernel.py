"""The C decode-attention kernel against the PyTorch reference, and its place in the engine."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, reference
from kernels.attention import select_ops

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler to build the CPU kernel")
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_decode_matches_reference(dtype, block_size, heads, kv_heads):
    lens = [1, 15, 16, 17, 33, 97, 130, 2000] + list(range(3, 600, 41))
    args = paged_case(lens, block_size, heads, kv_heads, 64, dtype)
    got = cpu_attention.paged_decode_attention(*args)
    want = reference.paged_decode_attention(*args)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_head_dim_128_and_a_single_sequence():
    args = paged_case([77], 16, 8, 2, 128, torch.float32, seed=3)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(*args),
                               reference.paged_decode_attention(*args), atol=1e-5, rtol=1e-5)


def test_unsupported_dtype_falls_back_to_reference():
    args = paged_case([5, 40], 16, 4, 2, 64, torch.float16)
    torch.testing.assert_close(cpu_attention.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_auto_backend_on_cpu_is_the_c_kernel():
    assert select_ops("auto", "cpu").name == "cpu"
    assert select_ops("torch", "cpu").name == "torch"
