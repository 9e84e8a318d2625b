"""Greedy verification: the longest accepted prefix and the bonus token stand, rejected drafts' slots go."""

from __future__ import annotations

from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampler import Sampled
from worker.engine.speculative.verifier import accepted_length, row_offsets, settle


def test_accepted_length():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0


def _running(bm: BlockManager, tokens: int) -> Sequence:
    seq = Sequence(Request("r", list(range(tokens))), 0, list(range(tokens)), tokens)
    seq.status = SeqStatus.RUNNING
    assert bm.allocate(seq, tokens)
    return seq


def test_settle_keeps_the_accepted_and_the_bonus_and_frees_the_rest():
    bm = BlockManager(16, 4)
    plain, spec = _running(bm, 5), _running(bm, 6)
    plain.num_computed_tokens, spec.num_computed_tokens = 4, 5  # each has its last token to compute
    spec.draft = [7, 8, 9, 10, 11]
    assert bm.allocate(spec, 1 + 5)  # its last token and the drafts: positions 5..10, three blocks
    spec.num_computed_tokens += 6  # the step ran
    assert len(spec.block_table) == 3
    rows = [plain, spec, spec, spec, spec, spec, spec]
    assert row_offsets(rows) == [0, 0, 1, 2, 3, 4, 5]
    sampled = Sampled([40, 7, 8, 50, 10, 11, 12], [None] * 7)  # the third draft token is refused
    kept, tokens, verified = settle(rows, sampled, bm)
    assert kept == [plain, spec, spec, spec] and tokens.token_ids == [40, 7, 8, 50]
    assert verified == [(spec, 5, 2)] and spec.draft == []
    # computed: its last token and the 2 accepted; the block of positions 8..10 held only rejected drafts
    assert spec.num_computed_tokens == 8 and len(spec.block_table) == 2
    assert bm.num_free_blocks == 16 - 2 - 2
    # named: each sequence's first block (real tokens 0..3); never a block holding a draft slot
    assert [bm.block_hash[b] is not None for b in spec.block_table] == [True, False]
    assert sum(h is not None for h in bm.block_hash) == 2
