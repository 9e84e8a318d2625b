"""The KV cache is reserved, not written: by default it is sized by what the running-request cap can
use, it takes memory only where blocks are used, a slot never written reads as zero, and the block
manager reuses the blocks it touched before it touches new ones."""

from __future__ import annotations

import pytest
import torch

from benchmarks.startup import resident_bytes
from worker.config import KV_AUTO_SHARE, Settings
from worker.engine.block_manager import BlockManager
from worker.engine.engine import Engine
from worker.engine.model_runner import available_memory, kv_cache_blocks
from worker.engine.request import Request, SamplingParams, Sequence

BLOCK_BYTES = 8192  # the tiny model: 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes


def kv_resident(engine: Engine) -> int:
    return sum(resident_bytes(t) for pair in engine.runner.kv_caches for t in pair)


def test_the_default_cache_holds_max_num_seqs_requests_and_touches_only_what_runs(tiny_loaded, text_ids):
    assert Settings().kv_memory == 0  # "auto"
    engine = Engine(loaded=tiny_loaded, max_num_seqs=64, threads=1)
    wanted = 64 * 2048 // 16  # 64 requests of the tiny model's 2048 tokens
    if KV_AUTO_SHARE * available_memory(torch.device("cpu")) < 2 * wanted * BLOCK_BYTES:
        pytest.skip("too little free memory for the auto size to be the model's")
    assert engine.runner.num_blocks == wanted and engine.runner.kv_bytes == wanted * BLOCK_BYTES
    assert kv_resident(engine) == 0, "nothing is written at start"
    prompts = [text_ids[i * 50:i * 50 + 40] for i in range(4)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert all(len(o.completions[0].token_ids) == 8 for o in outputs)
    used = 4 * 3  # 48 tokens each: 3 blocks
    touched = kv_resident(engine)
    assert 0 < touched <= 4 * used * BLOCK_BYTES, f"{touched} bytes resident for {used} blocks used"


def test_a_slot_never_written_reads_as_zero(tiny_loaded):
    """Attention weighs padding slots 0: a NaN of uninitialised memory there would make NaN outputs."""
    for _ in range(3):  # small caches, where an allocator would hand back memory freed a moment ago
        scratch = [torch.full((4096,), float("nan")) for _ in range(64)]
        del scratch
        engine = Engine(loaded=tiny_loaded, kv_memory="256KiB", threads=1)
        assert all(int(torch.count_nonzero(t)) == 0 for pair in engine.runner.kv_caches for t in pair)


def test_the_auto_size_is_capped_by_free_memory_and_explicit_sizes_win():
    def free() -> int:
        return 100 * BLOCK_BYTES

    assert kv_cache_blocks(0, BLOCK_BYTES, 16, 256, 2048, free) == int(KV_AUTO_SHARE * 100)
    assert kv_cache_blocks(0, BLOCK_BYTES, 16, 2, 100, lambda: 1 << 40) == 2 * 7  # 100 tokens: 7 blocks each
    assert kv_cache_blocks(0.5, BLOCK_BYTES, 16, 2, 100, free) == 50
    assert kv_cache_blocks(10 * BLOCK_BYTES, BLOCK_BYTES, 16, 2, 100, free) == 10


def _sequence(tokens: list[int]) -> Sequence:
    request = Request("r", list(tokens), SamplingParams(max_tokens=1))
    return Sequence(request=request, sample_index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def test_blocks_nothing_can_find_are_reused_before_new_ones():
    manager = BlockManager(8, 4, enable_prefix_cache=False)
    first = _sequence(list(range(8)))
    assert manager.allocate(first, 8) and first.block_table == [0, 1]
    manager.free_sequence(first)
    second, third = _sequence([5] * 4), _sequence([6] * 4)
    assert manager.allocate(second, 4) and manager.allocate(third, 4)
    assert (second.block_table, third.block_table) == ([0], [1]), "the touched blocks, before block 2"


def test_cached_blocks_stay_findable_while_new_blocks_are_free():
    manager = BlockManager(8, 4, enable_prefix_cache=True)
    first = _sequence(list(range(8)))
    assert manager.allocate(first, 8)
    manager.free_sequence(first)
    other = _sequence([9] * 4)
    assert manager.allocate(other, 4) and other.block_table == [2]
    assert manager.prefix_hits(_sequence(list(range(8)))) == [0], "the freed prompt's first block is still found"
