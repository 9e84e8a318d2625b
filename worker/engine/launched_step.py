"""A step launched on the device whose tokens the host has not read yet (``LaunchedStep``), and a step
that raised (``StepFailed``): what ``Engine.step`` keeps between launching a step and finishing it, so that
with the overlap on (``async_scheduling``) the next step is launched first, as vLLM's async scheduling
and SGLang's overlap scheduler do. docs/engine.md, "Overlapped steps", says what it changes."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from worker.engine.model_runner import SampleLaunch
from worker.engine.request import RequestOutput, SeqStatus, Sequence
from worker.engine.scheduler import Scheduler

_FINISHED = SeqStatus.FINISHED
_MATCHER, _PENALIZED = operator.attrgetter("matcher"), operator.attrgetter("request.params.penalized")


@dataclass
class LaunchedStep:
    """A step whose draw is launched and not yet read: its sampled rows (in the draw's order), the draw, the
    scheduler it ran under, and whether an n > 1 request forked in it."""

    rows: list[Sequence]
    draw: SampleLaunch
    scheduler: Scheduler
    forked: bool = False
    verifying: bool = False  # some rows score drafts (worker/engine/speculative/): a sequence's rows are several
    keep_on_host: bool = False  # a sequence would draft next step: the proposer reads its newest token

    def may_defer(self, rope_fixed: bool) -> bool:
        """Whether the host may read these tokens after launching the next step: no row needs its token on
        the host before its next draw (a grammar's matcher, a penalty's counts, an n > 1 request forking,
        a longrope model's switch of factors: ``rope_fixed`` False; drafts verified, or to be proposed)."""
        rows = self.rows
        return (rope_fixed and not self.forked and not self.verifying and not self.keep_on_host
                and list(map(_MATCHER, rows)).count(None) == len(rows) and not any(map(_PENALIZED, rows)))

    def defer(self, max_model_len: int) -> None:
        """Leave the tokens on the device: each row's sequence counts one token in flight, taken from row
        ``inflight_row`` of the draw by the next step's inputs; one that this token ends by length is not
        scheduled again (``Sequence.finishing``)."""
        for i, seq in enumerate(self.rows):
            if seq.status is _FINISHED:
                continue
            seq.inflight, seq.inflight_row = 1, i
            length = len(seq.token_ids) + 1  # ``Sequence.num_tokens`` with this token, without the calls
            seq.finishing = length - seq.num_prompt_tokens >= seq.request.params.max_tokens or length >= max_model_len


class StepFailed(Exception):
    """A step raised: the requests it finished before (``outputs``), the sequences it ran, the cause."""

    def __init__(self, outputs: list[RequestOutput], scheduled: list[tuple[Sequence, int]], exc: Exception):
        super().__init__(str(exc))
        self.outputs, self.scheduled, self.exc = outputs, scheduled, exc
