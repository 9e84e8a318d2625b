"""The block tables' mirror (``BlockManager.tables``): every sequence holding blocks has a row that says its
``block_table`` list, whatever the manager did to the list (blocks added, prefix hits, copy-on-write, a trim,
a swap in, a fork, a free); the KV slot utilization is counted from it; and a step's decode rows take their
tables from it: the same tables as padding the lists, in steps with preemption (recompute and swap), prefix
hits, n > 1 forks and speculation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from worker.engine import model_runner
from worker.engine.block_manager import BlockManager
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams, Sequence


def _check_mirror(bm: BlockManager, live: list[Sequence]) -> None:
    rows = [seq.table_row for seq in live if seq.block_table]
    assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0, "each sequence its own row"
    for seq in live:
        if not seq.block_table:
            assert seq.table_row == -1
            continue
        row = bm.tables[seq.table_row]
        assert row[:len(seq.block_table)].tolist() == seq.block_table
        assert not row[len(seq.block_table):].any(), "columns past the table are 0"
    filled: dict[int, int] = {}  # the slot utilization by its definition: each block as full as its fullest holder
    for seq in live:
        for i, b in enumerate(seq.block_table):
            filled[b] = max(filled.get(b, 0), min(bm.block_size, seq.num_computed_tokens - i * bm.block_size))
    expected = sum(filled.values()) / (len(filled) * bm.block_size) if filled else 1.0
    assert bm.slot_utilization(live) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(20))
def test_the_mirror_says_each_block_table_through_random_operations(seed):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=48, block_size=bs)
    request = Request("r", [1, 2, 3])
    live: list[Sequence] = []

    def fresh() -> Sequence:
        # a few distinct prompts, so that prefix hits come and go
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        return Sequence(request=request, sample_index=0, token_ids=tokens, num_prompt_tokens=len(tokens))

    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:  # admit: prefix hits, then the rest of the prompt
            seq = fresh()
            hits = bm.prefix_hits(seq)
            if bm.allocate(seq, seq.num_tokens - len(hits) * bs, hits):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        else:
            seq = rng.choice(live)
            if op < 0.6:  # decode a token, or a few (a draft's slots)
                n = 1 if rng.random() < 0.7 else rng.randrange(2, 6)
                if bm.allocate(seq, n):
                    seq.token_ids += [rng.randrange(3) for _ in range(n)]
                    seq.num_computed_tokens += n
            elif op < 0.7 and seq.block_table:  # drafts rejected: back to fewer tokens
                keep = rng.randrange(1, seq.num_computed_tokens + 1)
                del seq.token_ids[keep:]
                seq.num_computed_tokens = keep
                bm.trim(seq)
            elif op < 0.8:  # n > 1: a child shares every block, and writes its own copy of the last
                child = Sequence(request=request, sample_index=1, token_ids=list(seq.token_ids),
                                 num_prompt_tokens=seq.num_prompt_tokens)
                bm.fork(seq, child)
                live.append(child)
            elif op < 0.9:  # swapped out and in again
                computed = seq.num_computed_tokens
                bm.free_sequence(seq)
                if bm.swap_in(seq, computed) is None:
                    live.remove(seq)
            else:  # finished or preempted to recompute
                bm.free_sequence(seq)
                live.remove(seq)
        _check_mirror(bm, live)
    assert bm.pending_copies, "no copy-on-write happened: the test lost a case"


def test_a_step_gathers_the_tables_padding_the_lists_would_give(tiny_loaded, text_ids, monkeypatch):
    checked = []
    prepare = model_runner.ModelRunner.prepare

    def both(runner, scheduled, tables=None):
        gathered = prepare(runner, scheduled, tables)
        padded = prepare(runner, scheduled, None)
        a, b = gathered[0].decode_block_tables, padded[0].decode_block_tables
        assert a.shape[0] == b.shape[0] and a.shape[1] <= b.shape[1]
        assert np.array_equal(a.numpy(), b.numpy()[:, :a.shape[1]])
        checked.append(len(a))
        return gathered

    monkeypatch.setattr(model_runner.ModelRunner, "prepare", both)
    shared = text_ids[:40]
    prompts = [shared + text_ids[100 + 7 * i:100 + 7 * i + 3 + i % 29] for i in range(24)]
    params = [SamplingParams(max_tokens=24 + i % 9, temperature=0.8 if i % 4 == 0 else 0.0, seed=i,
                             n=2 if i % 5 == 0 else 1, ignore_eos=True) for i in range(24)]
    for mode in ("recompute", "swap"):  # a small cache: preemptions of either kind
        engine = Engine(loaded=tiny_loaded, kv_memory="160KiB", max_num_batched_tokens=48, max_num_seqs=12,
                        block_size=16, preemption_mode=mode)
        outputs = engine.generate(prompts, params)
        assert all(c.token_ids for o in outputs for c in o.completions)
        assert engine.stats.preemptions > 0 and engine.stats.prompt_tokens_cached > 0
    repeat = [text_ids[:30] * 3 for _ in range(3)]  # speculation drafts from the prompt: verified rows
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", speculation="auto")
    engine.generate(repeat, SamplingParams(max_tokens=32, temperature=0.0))
    assert engine.stats.verifications > 0, "no draft was verified: the test lost a case"
    assert sum(checked) > 0
