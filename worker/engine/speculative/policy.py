"""When to speculate and how far, decided each step (``Settings.speculation``): "off", "ngram:K" (every
sequence that may draft K tokens each step, for tests and measurement) or "auto".

Auto speculates where a draft token pays for itself. A decode step streams every weight for a handful of
tokens when few sequences run (a job's tail), and scoring a few more tokens per sequence costs little
more; with many running the step is compute-bound and every draft token costs as much as a decoded one
(vLLM #17984, #27379: n-gram slower at batch 32). So a draft token must pay, judged from what steps cost
here and what drafts are accepted: a step of ``rows`` rows takes ``a + b * rows`` seconds
(``step_cost.StepCost``, fitted from the steps' own times); a sequence's j-th draft token is kept with
probability ``p ** j`` (``p``, its measured acceptance per draft token, given the ones before it were
accepted) and costs ``b``. Draft tokens are taken most likely first while each adds more expected tokens
than the step's tokens per second would give for its cost (``p ** j * S >= b * T``, with ``T`` the step's
expected tokens and ``S`` its seconds so far): the most tokens a second this cost model gives. k thus
shrinks token by token as the batch grows and acceptance falls, with no cliff where speculation turns off
(vLLM #49548), and on a device whose steps cost nearly the same for 1 and 64 rows (a GPU's decode) it
drafts at batch sizes a CPU would not. Until the fit has seen steps of different sizes, a bar rising with
the running sequences stands in for it (from ``BAR_ONE`` with one running to 1 at ``max_running``);
``max_running`` caps auto in either case.

Acceptance is counted per sequence, decayed each time it is verified (``DECAY``), from an optimistic
prior; a sequence whose drafts fail stops drafting, and its estimate creeps back up while it does not
(``RECOVERY`` a step), so it tries again now and then. Under auto, a draft refused whole also rests its
sequence: 1 step, then twice as many after each refusal in a row (up to ``MAX_REST``), none once a draft
token is kept. A refused draft costs more than its rows: the step's tokens are read before the next step
is launched (``Drafts.keep_on_host``), so on a device whose steps the host overlaps the host's work stops
hiding; and where rows cost next to nothing (a GPU's decode) the cost model alone would retry a failing
sequence at every step its estimate crept above ``LEAST_CHANCE``.

Which sequences may draft at all: those decoding with their last token on the host
(``Sequence.inflight`` 0: the proposer reads it), of a model without longrope's switch of factors. Drafts
never exceed ``max_tokens`` or the model's length (with the bonus token), and never ask for KV blocks the
running sequences' next tokens may need. Seeded rows draft too: the verifier draws each position as the
engine would without drafts (``worker.engine.speculative.verifier``).

With a draft model (``speculative_model``, ``draft_model.py``): ``draft:K`` drafts K tokens from it for every
sequence that may; ``auto`` asks it, for the k chosen above, where prompt lookup has nothing. The choices made,
the model drafts for all of them in one batched run (``_model_drafts``).
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

from worker.engine.request import SeqStatus, Sequence
from worker.engine.speculative.draft_model import DraftModel
from worker.engine.speculative.job_suffix import CONFIDENT, JobSuffixIndex
from worker.engine.speculative.proposer import NgramIndex
from worker.engine.speculative.step_cost import StepCost

MAX_K = 8  # auto's longest draft
BAR_ONE = 0.3  # the acceptance a draft token needs with one sequence running (before the cost is fitted)
LEAST_CHANCE = 0.1  # a draft token less likely than this to be kept is never drafted, however cheap
DECAY = 0.8  # of the acceptance counts, at each verification
PRIOR = (3.0, 4.0)  # accepted, tried: an optimistic start (p = 0.75)
RECOVERY = 0.02  # accepted and tried added each step a sequence does not draft for its estimate
MAX_REST = 64  # steps a sequence sits out at most after drafts refused whole, in a row (auto)
MIN_N, MAX_N = 1, 3  # the n-grams looked up, longest first
MODEL_DRAFT = -1  # a draft token the draft model is still to propose (``SpeculationPolicy._model_drafts``)
BUCKET = 8  # a step with drafts has at most this many rows, or a multiple of it (``excess_rows``)


def parse(spec: str) -> tuple[str, int]:
    """"off" -> ("off", 0); "auto" -> ("auto", MAX_K); "ngram:K" -> ("ngram", K); "draft:K" -> ("draft", K)
    (K tokens from the draft model, ``draft_model.py``); ValueError else."""
    if spec in ("off", "auto"):
        return spec, (MAX_K if spec == "auto" else 0)
    m = re.fullmatch(r"(ngram|draft):(\d+)", spec)
    if m is None or not 1 <= int(m.group(2)) <= 32:
        raise ValueError(f"speculation {spec!r}: give auto, off, ngram:K or draft:K with K from 1 to 32")
    return m.group(1), int(m.group(2))


def excess_rows(rows: int, draft_tokens: int) -> int:
    """The draft tokens to drop from a step of ``rows`` rows so that it has at most ``BUCKET`` rows or a multiple
    of it (0 where its drafts cannot make up the difference). Drafts make each step's row count another;
    on the CPU a row count a linear layer has not seen costs oneDNN a new primitive for each weight
    shape, several times the step's own time, so steps with drafts keep to few counts."""
    over = rows % BUCKET if rows > BUCKET else 0
    return over if over <= draft_tokens else 0


@dataclass
class DraftState:
    """A sequence's proposer and its acceptance so far (``Sequence.spec``)."""

    index: NgramIndex = field(default_factory=lambda: NgramIndex(MIN_N, MAX_N))
    accepted: float = PRIOR[0]
    tried: float = PRIOR[1]
    from_job: bool = False  # its draft this step is the job's suffix index's, not its own n-grams'
    rest: int = 0  # steps it sits out before auto drafts for it again
    next_rest: int = 1  # the rest after its next draft refused whole

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``drafted`` tokens kept (a rejection is one more try)."""
        self.accepted = self.accepted * DECAY + accepted
        self.tried = self.tried * DECAY + accepted + (accepted < drafted)
        if accepted:
            self.next_rest = 1
        else:
            self.rest, self.next_rest = self.next_rest, min(2 * self.next_rest, MAX_REST)


@dataclass
class Drafts:
    """One step's decision: the sequences given drafts (``Sequence.draft`` set), and whether the step's
    tokens must be read on the host before the next is launched (a sequence that would draft has its
    token in flight: overlapped steps wait for it, ``LaunchedStep.may_defer``)."""

    seqs: list[Sequence]
    keep_on_host: bool = False


class SpeculationPolicy:
    def __init__(self, spec: str, max_running: int, max_model_len: int, block_size: int,
                 max_num_batched_tokens: int, rope_fixed: bool = True, draft_model: DraftModel | None = None):
        """``draft_model``: a draft model's proposer (``--speculative-model``), which ``draft:K`` needs and
        ``auto`` asks where prompt lookup has nothing."""
        self.mode, self.k = parse(spec)
        if self.mode == "draft" and draft_model is None:
            raise ValueError(f"speculation {spec!r} needs a draft model: set speculative_model")
        self.draft_model = draft_model
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enabled = self.mode != "off" and rope_fixed  # longrope: a switch of factors recomputes everything
        # drafts from the same tenant's same job's earlier prompts and outputs, fed by the engine (job_suffix.py)
        self.jobs = JobSuffixIndex() if self.enabled else None
        self.cost = StepCost()  # the engine tells it each decode step's time (``observe``)

    @property
    def measures(self) -> bool:
        """Whether it learns from the steps' times (``observe``): auto does, to choose its drafts."""
        return self.mode == "auto" and self.enabled

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt tokens in it) of ``rows`` rows, drafts included, took ``seconds``."""
        if self.measures:
            self.cost.observe(rows, seconds)

    def draft(self, running: list[Sequence], free_blocks: int) -> Drafts:
        """Give this step's drafts to the running sequences that should speculate."""
        if not self.enabled or not running or (self.mode == "auto" and len(running) > self.max_running):
            return Drafts([])
        tokens_left = self.max_num_batched_tokens - len(running)
        proposed: list[tuple[Sequence, list[int]]] = []
        for seq in running:
            if not self._may_draft(seq):
                continue
            state = seq.spec = seq.spec or DraftState()
            if state.rest and self.mode == "auto":
                state.rest -= 1
                continue
            # never past max_tokens or the model's length with the bonus token, never over the step's room
            k = min(self.k, seq.request.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1, tokens_left)
            draft = self._propose(seq, state, k) if k >= 1 else []
            if draft:
                proposed.append((seq, draft))
        ks = ([len(d) for _, d in proposed] if self.mode in ("ngram", "draft")
              else self._auto_ks([(seq.spec.acceptance, len(d)) for seq, d in proposed], len(running)))
        blocks_left = free_blocks - len(running)  # each running sequence's next token may need a block
        bs = self.block_size
        drafted, keep_on_host = [], False
        for (seq, draft), k in zip(proposed, ks):
            if k == 0:  # not worth it now: its estimate creeps back up meanwhile
                seq.spec.accepted += RECOVERY
                seq.spec.tried += RECOVERY
                continue
            draft = draft[:min(k, tokens_left)]
            if not draft:
                continue
            if seq.inflight:  # its newest token is on the device: it drafts next step, read on the host
                keep_on_host = True
                continue
            computed = seq.num_computed_tokens
            need = -(-(computed + 1 + len(draft)) // bs) - -(-(computed + 1) // bs)
            if need > blocks_left:
                continue
            blocks_left -= need
            tokens_left -= len(draft)
            seq.draft = draft
            drafted.append(seq)
        if self.draft_model is not None:
            drafted = self._model_drafts(drafted)
        return Drafts(drafted, keep_on_host or bool(drafted))

    def _propose(self, seq: Sequence, state: DraftState, k: int) -> list[int]:
        """The sequence's own prompt lookup, unless it has none or its job's suffix index matches more of its
        last tokens (the own n-grams match at most ``MAX_N``) with a path it is sure of (``CONFIDENT``): the
        job's draft then, ``state.from_job`` set. The job's index is only the request's tenant's and job's.
        Where neither has a draft, the draft model's (``draft:K`` asks it alone): ``k`` placeholders that hold
        the step's room until ``_model_drafts`` runs it over all of them at once."""
        state.from_job = False
        draft = [] if self.mode == "draft" else state.index.propose(seq.token_ids, k)
        request = seq.request
        if self.jobs is not None and request.job is not None and self.mode != "draft":
            job = self.jobs.propose(request.tenant, request.job, seq.token_ids, k)
            if job.tokens and (not draft or (job.matched > MAX_N and job.confidence >= CONFIDENT)):
                state.from_job = True
                return job.tokens
        if not draft and self.draft_model is not None and self.mode != "ngram":
            return [MODEL_DRAFT] * k
        return draft

    def _model_drafts(self, drafted: list[Sequence]) -> list[Sequence]:
        """The draft model's drafts in place of the placeholders, one batched run for all; a sequence it
        could give none (its draft cache full) drops out of the step's drafts."""
        wanted = [(seq, len(seq.draft)) for seq in drafted if seq.draft[0] == MODEL_DRAFT]
        if not wanted:
            return drafted
        for seq, draft in zip([seq for seq, _ in wanted], self.draft_model.propose(wanted)):
            seq.draft = draft
        return [seq for seq in drafted if seq.draft]

    def rollback(self, seq: Sequence, accepted: int) -> None:
        """``seq``'s draft was verified, ``accepted`` tokens of it kept (0: dropped before it ran): the draft
        model's cache keeps only those and the sequence's own."""
        if self.draft_model is not None:
            self.draft_model.rollback(seq, accepted)

    def release(self, seq: Sequence) -> None:
        """``seq`` is finished: its draft cache goes."""
        if self.draft_model is not None:
            self.draft_model.release(seq)

    def _may_draft(self, seq: Sequence) -> bool:
        p = seq.request.params
        return (seq.status is SeqStatus.RUNNING and not seq.finishing and p.embedding is None
                and (p.structured is None or seq.matcher is not None)
                and seq.num_output_tokens >= 1 and seq.num_computed_tokens == seq.num_tokens - 1)

    def _auto_ks(self, drafts: list[tuple[float, int]], running: int) -> list[int]:
        """Each proposed draft's length to score, from its sequence's acceptance and its length: the draft
        tokens that pay, most likely first (the module's doc)."""
        fit = self.cost.fit()
        if fit is None:
            bar = BAR_ONE + (1 - BAR_ONE) * (running - 1) / self.max_running
            return [min(n, self._auto_k(p, bar)) for p, n in drafts]
        a, b = fit
        tokens, seconds = float(running), a + b * running
        ks = [0] * len(drafts)
        chances = [min(p, 1.0) for p, _ in drafts]
        heap = [(-p, i) for i, p in enumerate(chances) if p >= LEAST_CHANCE]
        heapq.heapify(heap)
        while heap:
            value, i = heapq.heappop(heap)
            value = -value
            if value < LEAST_CHANCE or value * seconds < b * tokens:
                break
            ks[i] += 1
            tokens, seconds = tokens + value, seconds + b
            if ks[i] < min(drafts[i][1], MAX_K):
                heapq.heappush(heap, (-value * chances[i], i))
        return ks

    @staticmethod
    def _auto_k(p: float, bar: float) -> int:
        """The most draft tokens whose chance of being kept (p ** j for the j-th) reaches ``bar``."""
        if bar >= 1 or p < bar:
            return 0
        if p >= 1:
            return MAX_K
        return min(MAX_K, int(math.log(bar) / math.log(p)))
