"""The engine's counters (``EngineStats``) and one step's latencies (``StepLatencies``), as vLLM's
``v1/metrics/stats.py``: what the engine measured, for a reader of metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.engine.request import Sequence

CLASSES = ("batch", "interactive")  # a request's class, by ``Request.interactive``


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model
    prompt_tokens_cached: int = 0  # prompt tokens taken from the prefix cache instead
    recomputed_tokens: int = 0  # generated tokens computed again after a preemption
    output_tokens: int = 0
    output_tokens_by_tenant: Counter[str] = field(default_factory=Counter)
    # tokens run through the model, by class ("interactive", "batch") and kind ("prompt", "output": a
    # decode's input or a recomputed output token), so that each class's share of the steps can be read
    computed_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    requests_finished: int = 0
    preemptions: int = 0
    forward_seconds: float = 0.0
    slot_utilization_sum: float = 0.0  # of the samples taken every 8 steps (a sum: a worker runs for months)
    slot_utilization_count: int = 0
    # speculation (worker/engine/speculative/): draft tokens scored, those accepted, sequences verified
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    job_draft_tokens: int = 0  # of draft_tokens, those from the job's suffix index (speculative/job_suffix.py)
    job_accepted_tokens: int = 0  # of accepted_tokens, those

    def count_computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """Count a step's computed tokens, before their sequences advance: prompt tokens, generated ones
        computed again, and both by class."""
        by_class = [0, 0, 0, 0]  # batch prompt, batch output, interactive prompt, interactive output
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            num_tokens = len(seq.token_ids) + seq.inflight  # Sequence.num_tokens, without a call: every row asks
            if n == 1 and start == num_tokens - 1 and start >= seq.num_prompt_tokens:  # a decode
                by_class[2 * seq.request.interactive + 1] += 1
                continue
            end = start + n
            prompt = max(0, min(end, seq.num_prompt_tokens) - start)
            self.prompt_tokens_computed += prompt
            self.recomputed_tokens += max(0, min(end, num_tokens - 1) - max(start, seq.num_prompt_tokens))
            k = 2 * seq.request.interactive
            by_class[k] += prompt
            by_class[k + 1] += n - prompt
        for k, n in enumerate(by_class):
            if n:
                self.computed_tokens[CLASSES[k >> 1], ("prompt", "output")[k & 1]] += n

    def count_verified(self, drafted: int, accepted: int, from_job: bool = False) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verifications += 1
        if from_job:
            self.job_draft_tokens += drafted
            self.job_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        """Draft tokens accepted of those scored (0 before any)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def observe_slot_utilization(self, value: float) -> None:
        self.slot_utilization_sum += value
        self.slot_utilization_count += 1

    @property
    def mean_slot_utilization(self) -> float:
        n = self.slot_utilization_count
        return self.slot_utilization_sum / n if n else 0.0


@dataclass
class StepLatencies:
    """What one ``Engine.step`` measured for a reader of metrics (``Engine.latencies``, new every step):
    the time to first token of each request that got its first, and the times between a sequence's
    token and the one before, each with how many sequences had it (those of a step mostly share one)."""

    first_token: list[tuple[str, float]] = field(default_factory=list)  # (class, seconds since arrival)
    between_tokens: Counter[tuple[str, float]] = field(default_factory=Counter)  # (class, seconds) -> tokens
