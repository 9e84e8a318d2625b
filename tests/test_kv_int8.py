"""The int8 KV cache (``kv_cache_dtype="int8"``) in the engine: more blocks in the same memory, the
default model's greedy output close to the exact cache's, and a clear refusal where it cannot run.
The kernels' own checks are in test_cpu_kernel.py; checkpoints of int8 blocks in
test_checkpoint_resume.py."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import select_ops
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams

TEXTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def both(smol_loaded):
    """The default model's greedy tokens with the exact cache and with int8, and the two engines."""
    engines, tokens = {}, {}
    for kv in ("auto", "int8"):
        engine = Engine(loaded=smol_loaded, kv_memory="64MiB", kv_cache_dtype=kv, threads=2)
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        engines[kv], tokens[kv] = engine, [o.completions[0].token_ids for o in outs]
    return engines, tokens


def test_int8_holds_more_blocks_in_the_same_memory(both):
    engines, _ = both
    exact, int8 = engines["auto"].runner, engines["int8"].runner
    head_dim = exact.block_shape[-1]
    assert int8.block_shape[-1] == head_dim + 4 and int8.kv_dtype == torch.uint8
    assert int8.block_bytes * 4 * head_dim == exact.block_bytes * (head_dim + 4)  # 68 bytes a row against 256
    assert int8.num_blocks >= 3.7 * exact.num_blocks
    assert engines["int8"].fingerprint != engines["auto"].fingerprint


def test_default_model_int8_greedy_starts_as_the_exact_cache(both):
    """Greedy decoding from an int8 cache stays on the exact run's tokens at first; it may part later
    (it is not bit-exact: benchmarks/kv_int8.py measures how often)."""
    _, tokens = both
    for exact, int8 in zip(tokens["auto"], tokens["int8"]):
        assert len(int8) == 24
        assert int8[:4] == exact[:4]


def test_int8_refused_by_triton_and_not_picked_for_it():
    with pytest.raises(RuntimeError, match="kv_cache_dtype=int8 is not read by the Triton kernels"):
        select_ops("triton", "cuda", kv_cache_dtype="int8")
    assert select_ops("auto", "cuda", kv_cache_dtype="int8").name == "torch"


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Settings(kv_cache_dtype="int4")
