"""Each step, fill a token budget: running sequences first, then new prompts in chunks.

One loop, no prefill or decode phases: a running sequence asks for the tokens it has not computed
yet (one for a decode, the rest of its prompt for a chunked prefill), as many as the budget allows.
When the KV cache has no room, the lowest-priority, most recently admitted sequence is preempted:
its blocks are freed and it is recomputed later, or its blocks are copied to host memory and
copied back later (swap). Waiting sequences are admitted by priority, which grows with waiting
time (aging), so nothing starves; a prompt's cached prefix blocks are taken instead of computed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.request import SeqStatus, Sequence
from worker.engine.waiting_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, block to block
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks to save first
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks to fill
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 aging_steps: int = 50, preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, not {preemption_mode!r}")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.waiting = WaitingQueue(aging_steps)
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        self._admissions = itertools.count()

    # ---- queues
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one joins it (it shares the parent's blocks)."""
        seq.status = SeqStatus.RUNNING
        seq.admitted_order = next(self._admissions)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SeqStatus.FINISHED

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from wherever it is (abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- the step
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = sorted(self.running, key=lambda s: (-s.priority, s.admitted_order))
        while queue and budget:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
        budget = self._swap_in(out, budget)
        if not self.swapped:
            self._admit(out, budget)
        out.copies = self.bm.take_copies()
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting.next(self.step_count, self.running)
            hits = self.bm.prefix_hits(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
            if not self.bm.allocate(seq, n, hits):
                break
            self.waiting.remove(seq)
            self.add_running(seq)
            out.num_cached_tokens += len(hits) * self.bm.block_size
            out.scheduled.append((seq, n))
            budget -= n

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            computed = seq.num_computed_tokens
            blocks = self.bm.swap_in(seq, computed)
            if blocks is None:
                break
            n = min(seq.num_tokens - computed, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free_sequence(seq)
                seq.num_computed_tokens = computed
                break
            self.swapped.pop(0)
            out.swap_in.append((seq, blocks))
            self.add_running(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and seq.num_computed_tokens:
            computed = seq.num_computed_tokens
            out.swap_out.append((seq, list(seq.block_table)))
            self.bm.free_sequence(seq)
            seq.num_computed_tokens = computed
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free_sequence(seq)
            self.add(seq)
