"""The C kernel of the decoder's residual adds, norms, rotary and KV writes (kernels/cpu_elementwise.c)
against PyTorch's operations (worker.model.decoder's references), and the decoder using it."""

import math

import pytest
import torch

from kernels import cpu_elementwise
from kernels.reference import write_kv
from worker.config import cache_dir
from worker.model.decoder import apply_rotary, rms_norm

kernel = cpu_elementwise.load(cache_dir("kernels"))
# the other kind of CPU's build, where this one has AVX-512: its streaming stores are AVX2's
avx2_kernel = cpu_elementwise.load(cache_dir("kernels"), isa="avx2")
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def _threads_restored():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _close_to_the_norm(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Only the order of the squares' sum differs: float32 within its rounding; in bfloat16 a value whose
    float32 norm lies at a rounding boundary may round to the neighbouring bfloat16, no further."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
        return
    assert out.dtype == expected.dtype
    # a bfloat16 has 8 significant bits: one step at the value's scale, twice (the weight's multiply rounds again)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * 2**-8, atol=1e-6)
    assert (out != expected).float().mean() < 0.01, "more than a rare neighbour: the arithmetic differs"


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 100), (300, 576), (64, 17)])
def test_add_rms_norm_is_the_residual_add_and_the_norm(rows, dim, threads, dtype):
    torch.manual_seed(rows * dim)
    torch.set_num_threads(threads)
    h, delta, weight = ((torch.randn(rows, dim) * 3).to(dtype), torch.randn(rows, dim).to(dtype),
                        (torch.rand(dim) + 0.5).to(dtype))
    expected_h = h + delta
    expected = rms_norm(expected_h, weight, 1e-5)
    out = kernel.add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, expected_h)  # the add is the add: same rounding
    _close_to_the_norm(out, expected)
    again = kernel.add_rms_norm(h, None, weight, 1e-5)  # without a residual, h stays as it is
    assert torch.equal(h, expected_h)
    _close_to_the_norm(again, expected)


def test_bfloat16_add_rounds_to_nearest_even_as_pytorch():
    """Sums that fall exactly between two bfloat16 values, and ones just off the middle, round as PyTorch's add."""
    one = torch.tensor(1.0, dtype=torch.bfloat16)
    ulp = 2.0**-7  # of a bfloat16 in [1, 2)
    h = torch.full((1, 64), 1.0, dtype=torch.bfloat16)
    # halves of a step (ties: to even, up from an odd last bit and down from an even one), and a little off them
    delta = torch.tensor([ulp / 2, 3 * ulp / 2, ulp / 2 + ulp / 64, ulp / 2 - ulp / 64] * 16).to(torch.bfloat16)
    expected = h + delta[None]
    kernel.add_rms_norm(h, delta[None].contiguous(), torch.ones(64, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(h, expected)
    assert h[0, 0] == one and h[0, 1] == one + 2 * ulp  # the two ties, to even


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary (Phi-3 style: the first half of each head)
# the cache where it starts: on a cache line (each slot's rows stored past the caches) or a float after one
@pytest.mark.parametrize("misaligned", [0, 1])
@pytest.mark.parametrize("keep_keys", [False, True])  # the rotated keys in a tensor too (for a step's prefill)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_rotary_kv_rotates_queries_and_keys_and_writes_the_cache(rot, threads, misaligned, keep_keys, dtype, isa):
    built = avx2_kernel if isa else kernel
    torch.manual_seed(rot)
    torch.set_num_threads(threads)
    tokens, heads, kv_heads, dim, blocks, block_size = 37, 9, 3, 64, 10, 16
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim + 8) * 4).to(dtype)[:, 8:]  # rows with a stride, as a view
    positions = torch.randint(0, 500, (tokens,))
    angles = torch.rand(512, rot // 2) * 6
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(blocks * block_size)[:tokens]
    shape = (blocks, block_size, kv_heads, dim)
    # misaligned: a float32's or a bfloat16's width after a cache line
    k_cache, v_cache = (torch.zeros(math.prod(shape) + 64, dtype=dtype)[misaligned:misaligned + math.prod(shape)]
                        .view(shape) for _ in range(2))
    assert (k_cache.data_ptr() % 64 == 0) == (misaligned == 0)
    keys = torch.full((tokens, kv_heads, dim), float("nan"), dtype=dtype) if keep_keys else None
    q = built.rotary_kv(qkv, positions, cos, sin, heads, kv_heads, dim, k_cache, v_cache, slots, keys)

    eq, ek, ev = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(apply_rotary(ek.reshape(tokens, kv_heads, dim), c, s), ev.reshape(tokens, kv_heads, dim),
             expected_k, expected_v, slots)
    assert torch.equal(q, apply_rotary(eq.reshape(tokens, heads, dim), c, s))  # the same products and sums
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    if keep_keys:
        assert torch.equal(keys, apply_rotary(ek.reshape(tokens, kv_heads, dim), c, s))


# an int8 cache: rotary leaves the keys, the backend quantizes them in, and prefill sees a chunk's rows rounded
@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("float32", "int8"), ("bfloat16", "auto"),
                                                  ("bfloat16", "int8")])
def test_the_default_model_runs_the_kernel_and_gives_what_pytorchs_operations_give(smol_loaded, dtype, kv_cache_dtype):
    from worker.config import Settings
    from worker.engine.engine import Engine
    from worker.engine.request import SamplingParams

    engine = Engine(Settings(kv_memory=64 * 2**20, dtype=dtype, kv_cache_dtype=kv_cache_dtype), loaded=smol_loaded)
    model = engine.runner.model
    assert model.fused is not None, f"{dtype} on the CPU with the C attention kernel: the fused path"
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
    calls = []
    original = model._forward_fused
    model._forward_fused = lambda *a: calls.append(1) or original(*a)
    model.fused = None  # PyTorch's operations
    plain = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
    assert fused == plain
    assert not calls
