"""Each step, fill a token budget shared between tenants by weight, in one loop with no prefill or
decode phases (vLLM v1's scheduler): running sequences first, chunked prefill of waiting ones into
what is left, preemption (recompute or swap) when the KV cache has no room, interactive work served
ahead of batch work. docs/engine.md says how tenants, priorities and the two classes share a step."""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.fair_share import TokenShares, Turns
from worker.engine.job_tail import JobLengths
from worker.engine.request import SeqStatus, Sequence
from worker.engine.waiting_queue import WaitingQueue

_ADMITTED, _PRIORITY = operator.attrgetter("admitted_order"), operator.attrgetter("request.priority")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, block to block
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks to save first
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks to fill
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    prefix_hits: list[tuple[Sequence, int]] = field(default_factory=list)  # admitted with this many cached blocks

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
    asking: set[str]  # tenants whose claim to seats counts (WaitingQueue.may_seat)
    interactive: bool = False  # the class this pass serves
    below: _Step | None = None  # the batch pass of the same step: its running sequences make room for this one
    keep_free: int = 0  # KV blocks this pass leaves free (held for interactive work: ``_batch_headroom``)
    asked: set[str] = field(default_factory=set)  # tenants that asked for a seat this step
    partly: dict[Sequence, int] = field(default_factory=dict)  # given part of what they ask (more may follow)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 aging_steps: int = 50, preemption_mode: str = "recompute", interactive_seats: int = 0,
                 interactive_blocks: int = 0, interactive_step_tokens: int = 0, batch_floor: float = 0.0,
                 tail_first: bool = False):
        """``interactive_seats``: seats of ``max_num_seqs`` that batch work never takes (held for interactive);
        ``interactive_blocks``: KV blocks that batch sequences never hold; ``interactive_step_tokens``: the
        tokens of a step while interactive work is in the engine (0: ``max_num_batched_tokens``);
        ``batch_floor``: the share of a step's tokens batch work keeps while interactive work runs and
        batch work waits (``Settings.interactive_batch_floor``); ``tail_first``: a job whose waiting
        sequences fit in the batch's seats starts its longest first (``worker.engine.job_tail``)."""
        if not 0 <= batch_floor < 1:
            raise ValueError(f"batch_floor is a share of a step's tokens: at least 0, under 1, not {batch_floor}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, not {preemption_mode!r}")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.preemption_mode = preemption_mode
        self.interactive_seats = interactive_seats
        self.interactive_blocks = interactive_blocks
        self.interactive_step_tokens = interactive_step_tokens or max_num_batched_tokens
        self.batch_floor = batch_floor
        self.shares: dict[str, float] = {}  # tenant -> weight, 1.0 when not set
        self.lengths = JobLengths() if tail_first else None
        self.waiting = WaitingQueue(aging_steps, self.shares, max_num_seqs, self.lengths)
        self.fair = {False: TokenShares(self.shares), True: TokenShares(self.shares)}  # per class
        self.asking: dict[bool, set[str]] = {False: set(), True: set()}  # per class: asked for a seat last step
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
        if self.lengths is not None:
            self.lengths.finished(seq)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free_sequence(seq)
            seq.status = SeqStatus.FINISHED
        else:  # preempted while its last token was in flight (an overlapped step)
            self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from wherever it is (abort)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.bm.free_sequence(seq)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def set_back(self, seq: Sequence) -> None:
        """Out of this scheduler, blocks freed, as if preempted for recompute (a failed step's sequence):
        blocks the failed step was to fill are no longer findable in the prefix cache."""
        self.bm.forget_uncomputed(seq)
        self.remove(seq)
        seq.status = SeqStatus.WAITING

    def hand_over(self, seq: Sequence, to: Scheduler) -> None:
        """Move ``seq`` to the scheduler ``to`` as it is: a running one keeps its blocks and runs there,
        a waiting one waits there; one in neither stays where it is."""
        if seq in self.running:
            self.running.remove(seq)
            to.add_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            to.add(seq)

    def preempt_newest(self) -> Sequence | None:
        """Preempt the lowest-priority, most recently admitted running sequence for recompute (room for
        requests stepped apart); None when none runs."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda seq: (-seq.priority, seq.admitted_order))
        self.running.remove(victim)
        self.bm.free_sequence(victim)
        self.add(victim)
        return victim

    # ---- the step
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        lanes: dict[bool, dict[str, list[Sequence]]] = {False: {}, True: {}}
        order = sorted(self.running, key=_ADMITTED, reverse=True)
        order.sort(key=_PRIORITY)  # stable: by priority, then the latest admitted first; the best last
        for seq in order:
            if seq.finishing:  # its token in flight ends it: nothing more to compute
                continue
            request = seq.request
            lanes[request.interactive].setdefault(request.tenant, []).append(seq)
        batch = self._pass(False, lanes[False], out)
        budget = self.max_num_batched_tokens
        if lanes[True] or self.waiting.tenants(True) or any(s.request.interactive for s in self.swapped):
            bound = self.interactive_step_tokens
            streaming = sum(s.num_tokens - s.num_computed_tokens == 1 for q in lanes[True].values() for s in q)
            given = budget if not streaming else max(bound, streaming)  # a prompt alone is not cut
            floor = self.batch_floor if self._batch_waits(lanes[False]) else 0.0
            if floor:  # interactive work never takes more than the rest of the whole budget
                given = min(given, budget - math.ceil(floor * budget))
            used = given - self._serve(self._pass(True, lanes[True], out, below=batch), given)
            budget, left = min(budget - used, max(0, bound - used)), budget - used
            if floor:  # batch work's floor: at least ``floor`` of the step's tokens, beyond the bound if need be
                budget = max(budget, min(left, math.ceil(used * floor / (1 - floor))))
        if self.interactive_blocks:
            batch.keep_free = self._batch_headroom()
        self._serve(batch, budget)
        out.copies = self.bm.take_copies()
        return out

    def _batch_waits(self, running: dict[str, list[Sequence]]) -> bool:
        """Batch work is running, waiting or swapped out."""
        return bool(running or self.waiting.tenants(False)
                    or any(not s.request.interactive for s in self.swapped))

    def _batch_headroom(self) -> int:
        """The free blocks batch work must leave: those held for interactive work that interactive
        sequences do not hold yet (blocks two of them share count twice: a little more for batch)."""
        held = sum(len(s.block_table) for s in self.running if s.request.interactive)
        return max(0, self.interactive_blocks - held)

    def _pass(self, interactive: bool, queues: dict[str, list[Sequence]], out: SchedulerOutput,
              below: _Step | None = None) -> _Step:
        """One class's pass of a step, before its turns are drawn (``_serve``)."""
        seats = Counter({t: len(q) for t, q in queues.items()})
        asking = self.asking[interactive] | (self.waiting.tenants(interactive) - queues.keys())
        return _Step(out, 0, None, queues, seats, asking, interactive, below)

    def _serve(self, step: _Step, budget: int) -> int:
        """Serve one class's tenants in turn from ``budget``; what is left of it."""
        interactive = step.interactive
        tenants = (step.queues.keys() | self.waiting.tenants(interactive)
                   | {s.request.tenant for s in self.swapped if s.request.interactive == interactive})
        step.budget = budget
        step.turns = self.fair[interactive].turns(tenants, budget, step.seats)
        while step.budget and (tenant := step.turns.next()) is not None:
            self._turn(tenant, step)
        step.turns.end()
        self.asking[interactive] = step.asked
        step.out.scheduled += step.partly.items()
        step.partly = {}
        return step.budget

    def _turn(self, tenant: str, step: _Step) -> None:
        """Serve ``tenant`` up to one turn's tokens: its running sequences best first, then new ones;
        done for this step when it has nothing more it can run."""
        queue, partly, scheduled = step.queues.setdefault(tenant, []), step.partly, step.out.scheduled
        clock, start, rate = step.turns.clock, step.turns.clock[tenant], step.turns.rate[tenant]
        left = cap = step.turns.cap(tenant, step.budget)
        while left:
            if queue:  # the hot path, kept inline: a decode per running sequence per step
                seq = queue[-1]
                given = partly.get(seq, 0) if partly else 0
                wanted = seq.num_tokens + len(seq.draft) - seq.num_computed_tokens - given  # drafts: speculative/
                n = min(wanted, left)
                if not self.bm.allocate(seq, given + n, (), step.keep_free):
                    if seq.draft:  # a draft never costs a preemption: it goes instead (what was given stays)
                        del seq.draft[max(0, given - 1):]
                        continue
                    clock[tenant] = start + (cap - left) * rate  # up to date for the victim's choice
                    if not self._make_room(seq, given, n, step):
                        continue
                if n == wanted:
                    queue.pop()
                    scheduled.append((seq, given + n))
                    if given:
                        del partly[seq]
                else:
                    partly[seq] = given + n
            elif not (n := self._bring_in(tenant, left, step)):
                step.turns.done(tenant)
                break
            left -= n
        clock[tenant] = start + (cap - left) * rate
        step.budget -= cap - left

    def _make_room(self, seq: Sequence, given: int, n: int, step: _Step) -> bool:
        """Preempt by fairness until the cache has room for ``n`` more new tokens of ``seq`` (``given``
        already this step). False when ``seq`` itself goes: preempted, or left with what it was given
        (only sequences already served this step are left to preempt)."""
        while (victim := self._victim(step)) is not None:
            self._preempt(victim, step if victim.request.interactive == step.interactive else step.below)
            if victim is seq:
                return False
            if self.bm.allocate(seq, given + n, (), step.keep_free):
                return True
        step.queues[seq.request.tenant].pop()
        step.out.scheduled.append((seq, step.partly.pop(seq)))  # no victim: it is the one partly served
        return False

    def _victim(self, step: _Step) -> Sequence | None:
        """A batch sequence when an interactive one needs room (``_batch_victim``); else, of the
        tenant furthest over its share (in tokens, then in seats for its weight), the lowest-priority,
        most recently admitted running sequence of the class not yet served this step."""
        if step.below is not None and (victim := self._batch_victim(step.below)) is not None:
            return victim
        clock, seats, weight = step.turns.clock, step.seats, self.fair[step.interactive].weight
        candidates = [((clock[t], seats[t] / weight(t)), q[0]) for t, q in step.queues.items()
                      if q and q[0] not in step.partly]
        return max(candidates, key=lambda c: c[0])[1] if candidates else None

    def _batch_victim(self, batch: _Step) -> Sequence | None:
        """The running batch sequence to preempt for an interactive one: of the batch tenant holding
        the most seats for its weight, the lowest-priority, most recently admitted (none of them has
        been served yet: the interactive pass comes first)."""
        weight = self.fair[False].weight
        candidates = [(batch.seats[t] / weight(t), t) for t, q in batch.queues.items() if q]
        return batch.queues[max(candidates)[1]][0] if candidates else None

    def _room_for_interactive(self, step: _Step, fits) -> bool:
        """Preempt batch sequences until ``fits()``; False when none is left to preempt."""
        while not fits():
            victim = self._batch_victim(step.below) if step.below is not None else None
            if victim is None:
                return False
            self._preempt(victim, step.below)
        return True

    def _bring_in(self, tenant: str, limit: int, step: _Step) -> int:
        """Make ``tenant``'s next swapped-out or waiting sequence of the class run, with up to ``limit``
        tokens; the tokens given, none when it has no such sequence or there is no room (a seat, KV
        blocks, or a step that has just preempted one of its class). An interactive one takes the
        seat and blocks of batch sequences when it must (``_room_for_interactive``)."""
        interactive = step.interactive
        if any(s.request.interactive == interactive for s in step.out.preempted):
            return 0
        swapped = [s for s in self.swapped if s.request.interactive == interactive] if self.swapped else ()
        seat = lambda: self.max_num_seqs > len(self.running)  # noqa: E731
        seq = next((s for s in swapped if s.request.tenant == tenant), None)
        if seq is not None:
            if interactive and not self._room_for_interactive(step, seat):
                return 0
            return self._swap_in(seq, limit, step) if seat() else 0
        if swapped or not self.waiting.has(tenant, interactive):
            return 0
        step.asked.add(tenant)
        step.asking.add(tenant)
        if interactive:  # batch sequences give up their seats: only interactive ones count
            free, total = self.max_num_seqs - sum(step.seats.values()), self.max_num_seqs
        else:  # the seats interactive work left, less those held for it
            live = len(self.running) - sum(step.seats.values())
            free = self.max_num_seqs - len(self.running) - max(0, self.interactive_seats - live)
            total = free + sum(step.seats.values())
        if not self.waiting.may_seat(tenant, step.seats, free, total, step.asking, interactive):
            return 0
        seq = self.waiting.head(tenant, interactive)  # after the seat: a job's tail is a scan of its sequences
        hits = self.bm.prefix_hits(seq)
        n = min(seq.num_tokens - len(hits) * self.bm.block_size, limit)
        if interactive:
            if not self._room_for_interactive(step, seat):
                return 0
            if not self._room_for_interactive(step, lambda: self._admit(seq, n, hits, step)):
                return 0
        elif not self._admit(seq, n, hits, step):
            return 0
        self.waiting.remove(seq)
        cached = len(hits) * self.bm.block_size
        step.out.num_cached_tokens += cached
        if seq.request.cached_prompt_tokens is None:  # its first admission counts, not a recompute's
            seq.request.cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
        if hits:
            step.out.prefix_hits.append((seq, len(hits)))
        self._run(seq, n, step)
        return n

    def _admit(self, seq: Sequence, n: int, hits: list[int], step: _Step) -> bool:
        """Room for a waiting sequence's first ``n`` tokens that leaves ``_held_for_running``'s blocks."""
        keep, bound = step.keep_free, self._running_bound(step)
        return ((bound and self.bm.allocate(seq, n, hits, keep + bound))  # the common case: no count needed
                or self.bm.allocate(seq, n, hits, keep + self._held_for_running(step)))

    def _running_bound(self, step: _Step) -> int:
        """At most what ``_held_for_running`` holds: a block boundary each, and the budget's tokens."""
        unserved = sum(map(len, step.queues.values()))
        return unserved and unserved + -(-step.budget // self.bm.block_size)

    def _held_for_running(self, step: _Step) -> int:
        """Blocks the class's running sequences not yet served in full this step need for what they ask,
        up to the step's budget, which a sequence admitted or swapped in leaves them. Running work is
        served before new work (as in vLLM) though tenants' turns interleave the two: a sequence
        admitted in one tenant's turn that took the blocks a running one of another tenant needs would
        make that one preempt itself, and two prompts too long to share the cache, each readmitted from
        the prefix cache as the other is preempted, would take turns for ever."""
        if not (bound := self._running_bound(step)):
            return 0
        bs, partly, budget, held = self.bm.block_size, step.partly, step.budget, 0
        for queue in step.queues.values():
            for seq in queue:
                given = seq.num_computed_tokens + partly.get(seq, 0)
                wanted = min(seq.num_tokens + len(seq.draft) - given, budget)
                held += max(0, -(-(given + wanted) // bs) - len(seq.block_table))
        return min(held, bound)

    def _swap_in(self, seq: Sequence, limit: int, step: _Step) -> int:
        computed, keep = seq.num_computed_tokens, step.keep_free + self._held_for_running(step)
        blocks = self.bm.swap_in(seq, computed, keep)
        if blocks is None:
            return 0
        n = min(seq.num_tokens - computed, limit)
        if not self.bm.allocate(seq, n, (), keep):
            self.bm.free_sequence(seq)
            seq.num_computed_tokens = computed
            return 0
        self.swapped.remove(seq)
        step.out.swap_in.append((seq, blocks))
        self._run(seq, n, step)
        return n

    def _run(self, seq: Sequence, n: int, step: _Step) -> None:
        """``seq``, given room for ``n`` tokens, joins the running ones, next in its tenant's queue while
        it has more to compute."""
        tenant = seq.request.tenant
        self.add_running(seq)
        step.seats[tenant] += 1
        if n < seq.num_tokens - seq.num_computed_tokens:
            step.partly[seq] = n
            step.queues[tenant].append(seq)
        else:
            step.out.scheduled.append((seq, n))

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
