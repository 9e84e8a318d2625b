"""Scheduler checks and a faked model step: block accounting, a sequence of a given prompt length, a step."""

from __future__ import annotations

from collections import Counter

from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SamplingParams, SeqStatus, Sequence
from worker.engine.scheduler import Scheduler


def check_block_accounting(bm: BlockManager, seqs: list[Sequence]) -> None:
    held = Counter(b for s in seqs if s.status is SeqStatus.RUNNING for b in s.block_table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == held[block], f"block {block}: refcount {bm.ref_counts[block]} != {held[block]}"
        assert (block in bm.free) == (held[block] == 0)
    for h, block in bm.cached.items():
        assert bm.block_hash[block] == h


def make_seq(i: int, prompt: int, interactive: bool = False, max_tokens: int = 64) -> Sequence:
    request = Request(str(i), [i * 1000 + j for j in range(prompt)], SamplingParams(max_tokens=max_tokens))
    request.interactive = interactive
    seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids), num_prompt_tokens=prompt)
    request.sequences.append(seq)
    return seq


def fake_step(sched: Scheduler):
    """A step, with the model's part faked: scheduled tokens computed, a finished prefill or decode
    appends a token, a sequence at its max_tokens finishes."""
    plan = sched.schedule()
    for seq, n in plan.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
    return plan


def arrive(sched: Scheduler, request: Request) -> Sequence:
    """``request`` arrives at ``sched`` as the engine adds one: its one sequence, its arrival step."""
    seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids),
                   num_prompt_tokens=len(request.prompt_token_ids))
    request.sequences.append(seq)
    request.arrival_step = sched.step_count
    sched.add(seq)
    return seq
