"""Each step, fill a token budget, shared between tenants by weight: one loop over tenants' turns.

One loop, no prefill or decode phases: the tenant furthest behind its weight's share of the
tokens takes a turn (worker/engine/fair_share.py), and its best running sequence asks for the
tokens it has not computed yet (one for a decode, the rest of its prompt for a chunked prefill),
as many as the budget allows but no more than the tenant's share of the step while another tenant
has work; a tenant with no running sequence left to serve brings in its next swapped-out or
waiting one. Within a tenant, sequences go by priority, then admission order; waiting ones by
priority that grows with waiting time (aging), so nothing starves; a prompt's cached prefix blocks
are taken instead of computed. Priority is never compared across tenants.

When the KV cache has no room, a running sequence not yet served this step is preempted: of the
tenant furthest over its share, its lowest-priority, most recently admitted one. Its blocks are
freed and it is recomputed later, or its blocks are copied to host memory and copied back later
(swap). A step that preempted admits nothing new.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.fair_share import TokenShares, Turns
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


@dataclass
class _Step:
    """One ``schedule`` call as it goes: the budget left, whose turn, what each sequence was given."""

    out: SchedulerOutput
    budget: int
    turns: Turns
    queues: dict[str, list[Sequence]]  # per tenant, its running sequences not yet served in full, the next last
    seats: Counter[str]  # running sequences per tenant
    asking: set[str]  # tenants that asked for a seat this step (WaitingQueue.may_seat)
    granted: dict[Sequence, int] = field(default_factory=dict)  # new tokens, in the order first given


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 aging_steps: int = 50, preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, not {preemption_mode!r}")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.shares: dict[str, float] = {}  # tenant -> weight, 1.0 when not set
        self.waiting = WaitingQueue(aging_steps, self.shares)
        self.fair = TokenShares(self.shares)
        self.asking: set[str] = set()  # tenants that asked for a running seat in the last step
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
        queues: dict[str, list[Sequence]] = {}
        for seq in sorted(self.running, key=lambda s: (s.priority, -s.admitted_order)):  # best last
            queues.setdefault(seq.request.tenant, []).append(seq)
        seats = Counter({t: len(q) for t, q in queues.items()})
        tenants = queues.keys() | self.waiting.tenants() | {s.request.tenant for s in self.swapped}
        budget = self.max_num_batched_tokens
        step = _Step(SchedulerOutput(), budget, self.fair.turns(tenants, budget, seats), queues, seats, set())
        while step.budget and (tenant := step.turns.next()) is not None:
            queue = queues.setdefault(tenant, [])
            if queue:
                self._serve(queue[-1], step)
            elif not self._bring_in(tenant, step):
                step.turns.done(tenant)
        step.turns.end()
        self.asking = step.asking
        step.out.scheduled = list(step.granted.items())
        step.out.copies = self.bm.take_copies()
        return step.out

    def _serve(self, seq: Sequence, step: _Step) -> None:
        """One turn for ``seq``, its tenant's next running sequence; preempt by fairness when the cache is full."""
        given = step.granted.get(seq, 0)
        n = min(seq.num_tokens - seq.num_computed_tokens - given, step.turns.cap(seq.request.tenant, step.budget))
        while not self.bm.allocate(seq, given + n):
            victim = self._victim(step)
            if victim is None:  # only sequences already served this step are left: it keeps what it has
                step.queues[seq.request.tenant].pop()
                return
            self._preempt(victim, step)
            if victim is seq:
                return
        self._give(seq, n, step)

    def _victim(self, step: _Step) -> Sequence | None:
        """Of the tenant furthest over its share (in tokens, then in seats for its weight), the
        lowest-priority, most recently admitted running sequence not yet served this step."""
        clock, seats, weight = step.turns.clock, step.seats, self.fair.weight
        candidates = [((clock[t], seats[t] / weight(t)), q[0]) for t, q in step.queues.items()
                      if q and q[0] not in step.granted]
        return max(candidates, key=lambda c: c[0])[1] if candidates else None

    def _bring_in(self, tenant: str, step: _Step) -> bool:
        """Make ``tenant``'s next swapped-out or waiting sequence run, with its first tokens; False when
        it has none or there is no room (a seat, KV blocks, or a step that has just preempted)."""
        if step.out.preempted:
            return False
        free = self.max_num_seqs - len(self.running)
        seq = next((s for s in self.swapped if s.request.tenant == tenant), None)
        if seq is not None:
            return free > 0 and self._swap_in(seq, step)
        seq = self.waiting.head(tenant)
        if seq is None or self.swapped:
            return False
        step.asking.add(tenant)
        if not self.waiting.may_seat(tenant, step.seats, free, self.max_num_seqs, self.asking | step.asking):
            return False
        hits = self.bm.prefix_hits(seq)
        n = min(seq.num_tokens - len(hits) * self.bm.block_size, step.turns.cap(tenant, step.budget))
        if not self.bm.allocate(seq, n, hits):
            return False
        self.waiting.remove(seq)
        step.out.num_cached_tokens += len(hits) * self.bm.block_size
        self._run(seq, n, step)
        return True

    def _swap_in(self, seq: Sequence, step: _Step) -> bool:
        computed = seq.num_computed_tokens
        blocks = self.bm.swap_in(seq, computed)
        if blocks is None:
            return False
        n = min(seq.num_tokens - computed, step.turns.cap(seq.request.tenant, step.budget))
        if not self.bm.allocate(seq, n):
            self.bm.free_sequence(seq)
            seq.num_computed_tokens = computed
            return False
        self.swapped.remove(seq)
        step.out.swap_in.append((seq, blocks))
        self._run(seq, n, step)
        return True

    def _run(self, seq: Sequence, n: int, step: _Step) -> None:
        """``seq`` (given room for ``n`` tokens) joins the running ones, next in its tenant's queue."""
        self.add_running(seq)
        step.seats[seq.request.tenant] += 1
        step.queues[seq.request.tenant].append(seq)
        self._give(seq, n, step)

    def _give(self, seq: Sequence, n: int, step: _Step) -> None:
        tenant = seq.request.tenant
        step.granted[seq] = given = step.granted.get(seq, 0) + n
        step.budget -= n
        step.turns.charge(tenant, n)
        if given == seq.num_tokens - seq.num_computed_tokens:
            step.queues[tenant].pop()

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        tenant = seq.request.tenant
        step.queues[tenant].remove(seq)
        step.seats[tenant] -= 1
        self.running.remove(seq)
        self.num_preemptions += 1
        step.out.preempted.append(seq)
        if self.preemption_mode == "swap" and seq.num_computed_tokens:
            computed = seq.num_computed_tokens
            step.out.swap_out.append((seq, list(seq.block_table)))
            self.bm.free_sequence(seq)
            seq.num_computed_tokens = computed
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.bm.free_sequence(seq)
            self.add(seq)
