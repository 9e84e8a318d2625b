"""How many tokens a step may carry while interactive requests run, so that it takes about a set time.

A live caller gets one token a step: the time of a step is the time between its tokens. Batch work
fills a step to the budget (2,048 tokens by default), which takes seconds on a CPU and would set the
pace of every stream beside it. So while interactive requests run, the scheduler bounds a step's
tokens (``Scheduler.interactive_step_tokens``: interactive work takes what it needs, batch work the
rest), and this sets that bound from what steps cost on this machine: after each step that carried
interactive decodes, the seconds per token of that step (overhead included) go into a moving average,
and the bound becomes ``target / seconds per token``. If a step costs ``a + b * n`` seconds for ``n``
tokens, the bound settles where ``a + b * n = target`` (each update moves it ``a / target`` of the
way closer), on any device, with no figure measured by hand: a GPU, whose steps take milliseconds,
is barely bound at all.

Only full steps (as many tokens as the bound) whose interactive rows were all decodes teach it. A step
of a few streams alone costs mostly its fixed part (the weights read once a step), which would make
tokens look dear and the bound small for no gain; and a step that prefills a new interactive prompt
costs what prompt tokens cost, not what the decodes that fill the other steps do.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.scheduler import SchedulerOutput

SMOOTHING = 0.3  # the weight of the newest step in the moving average
FIRST_BOUND = 64  # tokens, before any step has been measured


@dataclass
class StepPace:
    target: float  # seconds a step should take while interactive requests run; 0: no bound
    most: int  # the step's token budget (max_num_batched_tokens): the bound never exceeds it
    least: int = 16  # the bound never falls below it, so batch work keeps moving beside a few streams
    seconds_per_token: float | None = None

    @property
    def tokens(self) -> int:
        """The bound on a step's tokens while interactive requests run."""
        if not self.target:
            return self.most
        if self.seconds_per_token is None:
            return min(FIRST_BOUND, self.most)
        return max(self.least, min(self.most, int(self.target / self.seconds_per_token)))

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        """A step ran ``plan`` in ``seconds``: learn from it if it was full and its interactive rows were
        all decodes."""
        interactive = [n for seq, n in plan.scheduled if seq.request.interactive]
        if not interactive or max(interactive) > 1 or plan.num_tokens < self.tokens or seconds <= 0:
            return
        rate = seconds / plan.num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else old + SMOOTHING * (rate - old)
