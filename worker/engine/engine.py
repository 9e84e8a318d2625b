"""The engine, as vLLM's ``EngineCore``: requests in at any moment (``add_request``), one scheduled
step at a time (``step``: schedule, run the model on one flattened batch, sample, stop), finished
requests out; ``abort`` drops one at once. Its parts: ``admission`` (checks, waiting for grammars),
``isolation`` (a failed step split in halves, isolated suspects), ``stop_checker``, ``stats`` and
``kv_view`` (the KV cache as checkpoints see it). docs/engine.md tells a request's life.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from worker.config import Settings
from worker.engine import admission, pooling, stop_checker
from worker.engine.admission import GrammarWaits, RequestRejected
from worker.engine.block_manager import BlockManager
from worker.engine.isolation import Isolation
from worker.engine.kv_view import KVView, RequestState, SampleState, SharedPrefix, fingerprint
from worker.engine.launched_step import LaunchedStep, StepFailed
from worker.engine.model_runner import ModelRunner, decode_rows_first, fill_inputs
from worker.engine.penalties import TokenCounts
from worker.engine.request import Completion, Request, RequestOutput, SamplingParams, SeqStatus, Sequence
from worker.engine.sampler import SampleRow
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.simulated_device import SimulatedRunner
from worker.engine.speculative import verifier
from worker.engine.speculative.draft_model import DraftModel, check_same_tokenizer
from worker.engine.speculative.policy import Drafts, SpeculationPolicy, excess_rows
from worker.engine.stats import CLASSES, EngineStats, StepLatencies
from worker.engine.step_pace import StepPace
from worker.engine.stop_checker import may_finish
from worker.engine.structured import grammar
from worker.model.architectures import context_length
from worker.model.base import LoadedModel
from worker.model.loader import load_model
from worker.model.rotary import long_rope, long_rope_from
from worker.process_clock import seconds_since_start

log = logging.getLogger("berth.engine")
_FINISHED = SeqStatus.FINISHED
_DRAFT, _MATCHER = operator.attrgetter("draft"), operator.attrgetter("matcher")
_PLAIN_GREEDY = operator.attrgetter("request.plain_greedy")
_SAMPLES = operator.attrgetter("request.params.n")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# names other code imports from here: the engine's public API
__all__ = ["DTYPES", "CLASSES", "Engine", "EngineStats", "RequestRejected", "RequestState", "SampleState",
           "SharedPrefix", "StepLatencies", "describe_model"]


class Engine:
    def __init__(self, settings: Settings | None = None, *, loaded: LoadedModel | None = None, **overrides):
        """``loaded`` reuses a model already read from disk (its weights are copied, not shared)."""
        if overrides:
            settings = Settings(**{**(settings.model_dump() if settings else {}), **overrides})
        self.settings = settings = settings or Settings()
        self.device = torch.device(settings.resolved_device())
        settings.check_kv_cache_dtype(str(self.device))
        if self.device.type == "cpu":
            torch.set_num_threads(settings.resolved_threads())
        dtype = DTYPES[settings.dtype]
        if loaded is None:
            log.info("loading model %s (%s, %s)", settings.model_path(), settings.dtype, self.device)
            t0 = time.perf_counter()
            loaded = load_model(settings.model_path(), dtype)
            log.info("weights loaded in %.1fs: %s", time.perf_counter() - t0, describe_model(loaded.config))
        self.model_config = loaded.config
        self.model_path = loaded.path  # what was loaded, also when ``loaded`` was handed in
        self.tokenizer = loaded.tokenizer
        self.model_name = settings.served_model_name()
        context = context_length(loaded.config)  # the whole context: sliding windows do not cap it
        self.max_model_len = min(settings.max_model_len or context, context)
        self.long_rope_from = long_rope_from(loaded.config)  # None but for a longrope model
        if settings.simulated_device:  # benchmarks and tests only: a GPU's pace, no model (simulated_device.py)
            self.runner = SimulatedRunner(loaded, settings.simulated_device, block_size=settings.block_size,
                                          max_seqs=settings.max_num_seqs, max_model_len=self.max_model_len)
        else:
            self.runner = ModelRunner(loaded, dtype=dtype, device=self.device, block_size=settings.block_size,
                                      kv_memory=settings.kv_memory, attention_backend=settings.attention_backend,
                                      max_seqs=settings.max_num_seqs, max_model_len=self.max_model_len,
                                      kv_cache_dtype=settings.kv_cache_dtype, weight_dtype=settings.weight_dtype,
                                      cuda_graphs=settings.cuda_graphs)
        self.block_manager = BlockManager(self.runner.num_blocks, settings.block_size,
                                          settings.enable_prefix_cache)
        # the tokens of a step while interactive requests run, learnt from the steps' times
        self.pace = StepPace(settings.interactive_step_seconds, settings.max_num_batched_tokens)
        mode = settings.preemption_mode
        if mode == "auto":  # swapping pays where the cache lives apart from host memory
            mode = "swap" if self.device.type == "cuda" else "recompute"
        self.scheduler = Scheduler(self.block_manager, settings.max_num_batched_tokens, settings.max_num_seqs,
                                   settings.aging_steps, mode,
                                   interactive_seats=int(settings.max_num_seqs * settings.interactive_seats),
                                   interactive_blocks=int(self.runner.num_blocks * settings.interactive_kv_blocks),
                                   interactive_step_tokens=self.pace.tokens,
                                   batch_floor=settings.interactive_batch_floor, tail_first=settings.tail_first)
        self.eos_token_ids = _eos_ids(loaded.config, self.tokenizer, loaded.path)
        self.vocab_size = loaded.config.vocab_size
        self.hidden_size = loaded.config.hidden_size  # an embedding's length before ``dimensions`` cuts it
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.latencies = StepLatencies()
        self._swapped_kv: dict[int, torch.Tensor] = {}
        # Requests marked ``Request.isolated`` (a worker's crash suspects) are scheduled apart, over the same
        # KV cache; while any is in the engine, only they step. A failed step's requests are tried in halves.
        self.isolation = Isolation(self.scheduler, self._side_scheduler,
                                   lambda seq: self._swapped_kv.pop(seq.seq_id, None))
        self._compiling = GrammarWaits()  # waiting for their grammar, outside the scheduler
        self.kv = KVView(self.block_manager, self.runner, self.requests, self.long_rope_from)
        # Told the ids of requests about to run for the first time, before the step that runs them: a
        # worker that dies in that step has said which requests it was running (poison counts them).
        self.on_start: Callable[[list[str]], None] | None = None
        # Steps overlapped with the device (``step``): on where the device runs apart from the host
        self.overlap = settings.async_scheduling == "on" or (settings.async_scheduling == "auto" and (
            bool(settings.simulated_device) or self.device.type == "cuda"))
        self._in_flight: LaunchedStep | None = None  # the step whose tokens the host has not read yet
        # Drafts from each sequence's own tokens, its job's earlier ones or a draft model, verified in the step
        # (worker/engine/speculative/)
        self.speculation = SpeculationPolicy(settings.speculation, settings.speculation_max_running,
                                             self.max_model_len, settings.block_size,
                                             settings.max_num_batched_tokens, self.long_rope_from is None,
                                             draft_model=self._draft_model(loaded, dtype))
        self._last_decode_end: float | None = None  # when the last step, a decode step, ended
        log.info("engine ready (%.1fs since the process started)", seconds_since_start())

    def _draft_model(self, target: LoadedModel, dtype: torch.dtype) -> DraftModel | None:
        """The draft model of ``speculative_model`` where speculation may use it (``draft:K``, ``auto``), its
        tokenizer checked against the target's before any request runs."""
        s = self.settings
        if not s.speculative_model or s.speculation == "off" or s.speculation.startswith("ngram"):
            return None
        log.info("loading draft model %s", s.speculative_model)
        loaded = load_model(s.speculative_model, dtype)
        check_same_tokenizer(loaded, target, s.speculative_model, target.path)
        return DraftModel(loaded, target_blocks=self.runner.num_blocks, target_vocab=self.vocab_size, dtype=dtype,
                          device=self.device, block_size=s.block_size, attention_backend=s.attention_backend)

    # ---- requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in the engine")
        p = request.params
        admission.check(request, self._limits())
        request.stop_ids = (() if p.ignore_eos else self.eos_token_ids) + tuple(p.stop_token_ids)
        request.stop_set = frozenset(request.stop_ids)
        request.plain_greedy = p.greedy and not p.processed and p.logprobs is None and not p.min_tokens
        request.arrival_step = self.scheduler.step_count
        if request.arrival_time is None:
            request.arrival_time = time.perf_counter()
        request.sequences = []
        jobs = self.speculation.jobs  # None with speculation off: nothing fed
        if jobs is not None and request.job is not None and p.embedding is None:
            jobs.feed_prompt(request.tenant, request.job, request.prompt_token_ids)
        if p.embedding is not None:  # an input per sequence, each prefilled and pooled, none sampled
            for i, ids in enumerate(request.inputs()):
                seq = self._new_sequence(request, i, ids)
                seq.cache_prefix = self.runner.pooling == pooling.LAST  # the mean needs every row computed
        elif request.resume_output_ids:
            if len(request.resume_output_ids) != p.n:
                raise RequestRejected(f"request {request.request_id}: resume state has "
                                      f"{len(request.resume_output_ids)} samples, n is {p.n}")
            for i, out in enumerate(request.resume_output_ids):
                self._new_sequence(request, i, list(request.prompt_token_ids) + list(out))
        else:
            self._new_sequence(request, 0, list(request.prompt_token_ids))
        self.requests[request.request_id] = request
        if p.structured is not None:
            self._compiling.submit(request, self.grammars, grammar.CompileRules.of(self.settings))
            return
        for seq in request.sequences:
            self._home(request).add(seq)

    def _limits(self) -> admission.Limits:
        bs, blocks = self.block_manager.block_size, self.runner.num_blocks
        return admission.Limits(self.max_model_len, self.vocab_size, self.hidden_size, blocks * bs,
                                (blocks - self.scheduler.interactive_blocks) * bs)

    @functools.cached_property
    def grammars(self) -> grammar.Compiler:
        """Structured outputs' compiler for this model's tokenizer, logits width and EOS (built on first use)."""
        return grammar.compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar compiled join the scheduler; those whose grammar failed are failed with
        the reason. With nothing else to run, wait a moment for a compile first."""
        iso = self.isolation
        scheduled = iso.apart.has_work() if self._isolating() else self.scheduler.has_work()
        if self._compiling and not scheduled and not iso.probation:
            self._compiling.wait(timeout=0.05)
        outputs = []
        for request, exc in self._compiling.take_done():
            if exc is not None:  # a grammar that does not compile is the request's own: a 400
                outputs.append(self._fail(request, exc, rejected=isinstance(exc, grammar.GrammarError)))
                continue
            for seq in request.sequences:
                self._home(request).add(seq)
        return outputs

    def abort(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self._compiling:
            self._compiling.remove(request)
            return True
        for seq in request.sequences:
            if not seq.is_finished:
                self._home(request).remove(seq)
            self._swapped_kv.pop(seq.seq_id, None)
            self.speculation.release(seq)
        return True

    def set_tenant_share(self, tenant: str, share: float) -> None:
        """Weight of ``tenant`` in each step's tokens and in running seats: with shares 2 and 1, twice
        the tokens while both have work (the scheduler's turns, worker/engine/fair_share.py)."""
        if share <= 0:
            raise ValueError("a tenant's share must be positive")
        self.scheduler.shares[tenant] = share

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- checkpoints: the KV cache as a typed view (``self.kv``); these names delegate to it
    def request_state(self, request_id: str) -> RequestState | None:
        return self.kv.request_state(request_id)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv.read_blocks(block_ids)

    def load_kv_blocks(self, block_hashes: list[bytes], data: torch.Tensor) -> int:
        return self.kv.load_blocks(block_hashes, data)

    def prefix_block_hashes(self, request: Request) -> list[bytes]:
        return self.kv.prefix_block_hashes(request)

    def cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        return self.kv.cached_prefix_blocks(block_hashes)

    def take_shared_prefixes(self) -> list[SharedPrefix]:
        return self.kv.take_shared_prefixes()

    @property
    def watch_shared_prefixes(self) -> bool:
        return self.kv.watch_shared_prefixes

    @watch_shared_prefixes.setter
    def watch_shared_prefixes(self, on: bool) -> None:
        self.kv.watch_shared_prefixes = on

    @functools.cached_property
    def fingerprint(self) -> str:
        """Names the KV cache's meaning (``kv_view.fingerprint``): checkpointed blocks are reused only under it."""
        return fingerprint(self.model_path, self.settings)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.isolation.apart.running)

    def queued_to_start(self) -> list[str]:
        """Requests in the scheduler's queue that no step has run yet (not those waiting for a grammar,
        nor suspects set apart): what the next steps start, as seats free."""
        return list(dict.fromkeys(seq.request.request_id for seq in self.scheduler.waiting
                                  if not seq.request.started and not seq.request.isolated))

    @property
    def num_waiting(self) -> int:
        """Sequences not running: never admitted, preempted, swapped out, or suspects of a failed step."""
        return (len(self.scheduler.waiting) + len(self.scheduler.swapped) + self.isolation.num_waiting
                + self._compiling.num_sequences)

    # ---- the step
    def step(self) -> list[RequestOutput]:
        """One scheduled step; the requests it finished (or failed, with ``RequestOutput.error``). A failed
        step's requests are tried again in halves, and isolated requests step alone (docs/engine.md).

        Overlapped (``overlap``): the step is launched before the host reads the tokens of the one before,
        which it finishes while the device runs this one; a sequence's token in flight is counted
        (``Sequence.inflight``) and the next step takes it as input on the device. So a request finishes in
        the step after the one that sampled its last token; its text is the same."""
        self.latencies = StepLatencies()
        outputs = self._admit_compiled() if self._compiling else []
        previous, self._in_flight = self._in_flight, None
        if self.isolation.probation:
            outputs += self._resolve(previous)
            return outputs + self.isolation.probe_step(self._run, lambda r: r.request_id in self.requests)
        if self._isolating():
            outputs += self._resolve(previous)
            return outputs + self._isolated_step()
        t0 = time.perf_counter()
        drafts = self.speculation.draft(self.scheduler.running, self.block_manager.num_free_blocks)
        plan = self.scheduler.schedule()
        if drafts.seqs:
            _fit_drafts(drafts, plan, self.block_manager)
            for seq in drafts.seqs:
                if not seq.draft:  # dropped before it ran: a draft model's cache keeps only the sequence's tokens
                    self.speculation.rollback(seq, 0)
        decoding = self.speculation.measures and bool(plan.scheduled) and all(
            n == 1 + len(seq.draft) and seq.num_computed_tokens >= seq.num_prompt_tokens for seq, n in plan.scheduled)
        try:
            done, launched = self._launch(plan, self.scheduler, previous)
        except StepFailed as failed:  # the tokens before it first: the failure sets its sequences back
            for seq in drafts.seqs:
                seq.draft = []
                self.speculation.rollback(seq, 0)
            outputs += failed.outputs + self._resolve(previous)
            alive = [(seq, n) for seq, n in failed.scheduled
                     if not seq.is_finished and seq.request.request_id in self.requests]
            return outputs + self._step_failed(alive, self.scheduler, failed.exc)
        outputs += done + self._resolve(previous)
        if launched is not None:
            launched.keep_on_host = drafts.keep_on_host
            if self.overlap and launched.may_defer(self.long_rope_from is None):
                launched.defer(self.max_model_len)
                self._in_flight = launched
            else:
                outputs += self._resolve(launched)
        end = time.perf_counter()
        self.pace.observe(plan, end - t0)
        self.scheduler.interactive_step_tokens = self.pace.tokens
        if decoding and self._last_decode_end is not None:  # what a step of so many rows costs, for speculation
            self.speculation.observe(plan.num_tokens, end - self._last_decode_end)
        self._last_decode_end = end if decoding else None  # a gap (idle, a prefill) is no decode step's cost
        return outputs

    # ---- isolation
    def release(self, request_id: str) -> None:
        """An isolated request rejoins the others: it runs in ordinary steps from now on (its blocks kept)."""
        request = self.requests.get(request_id)
        if request is not None and request.isolated:
            self.isolation.release(request)

    def _isolating(self) -> bool:
        return self.isolation.active(self._compiling.any_isolated())

    def _home(self, request: Request) -> Scheduler:
        """The scheduler a request's sequences belong to."""
        return self.isolation.home(request)

    def _side_scheduler(self) -> Scheduler:
        """A scheduler over the engine's KV cache for a few requests stepped apart from the rest."""
        s = self.settings
        return Scheduler(self.block_manager, s.max_num_batched_tokens, s.max_num_seqs, s.aging_steps, "recompute")

    def _isolated_step(self) -> list[RequestOutput]:
        outputs, preempted = self.isolation.isolated_step(self._run)
        self.stats.preemptions += preempted
        return outputs

    def _run(self, plan: SchedulerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        """Run ``plan`` and read its tokens at once (isolated and probing steps)."""
        try:
            outputs, launched = self._launch(plan, scheduler, None)
        except StepFailed as failed:
            return failed.outputs + self._step_failed(failed.scheduled, scheduler, failed.exc)
        return outputs + self._resolve(launched)

    def _launch(self, plan: SchedulerOutput, scheduler: Scheduler,
                previous: LaunchedStep | None) -> tuple[list[RequestOutput], LaunchedStep | None]:
        """Run ``plan`` on the device and launch its draw; the requests it finished without a draw (pooled
        embeddings) and the draw, None when nothing samples. ``previous``: the step in flight, whose tokens
        are this one's inputs where it decodes them. ``StepFailed`` when the step raised."""
        self.stats.preemptions += len(plan.preempted)
        self.stats.prompt_tokens_cached += plan.num_cached_tokens
        for seq, blocks in plan.swap_out:
            self._swapped_kv[seq.seq_id] = self.runner.read_blocks(blocks)
        self.runner.copy_blocks(plan.copies)
        for seq, blocks in plan.swap_in:
            self.runner.write_blocks(blocks, self._swapped_kv.pop(seq.seq_id))
        if not plan.scheduled:
            return [], None
        fresh = [seq.request for seq, _ in plan.scheduled if not seq.request.started]
        if fresh:
            for request in fresh:
                request.started = True
            if self.on_start is not None:
                self.on_start(list(dict.fromkeys(r.request_id for r in fresh)))
        scheduled = decode_rows_first(plan.scheduled)
        try:
            step_input, samplers, pool = self.runner.prepare(scheduled, self.block_manager.tables)
            if previous is not None:
                fill_inputs(step_input, previous.draw.tokens)
            t0 = time.perf_counter()
            logits, pooled = self.runner.execute(step_input)
            if pool is not None:
                pooling.pool_step(pool, pooled, self.runner.pooling)
            self.stats.forward_seconds += time.perf_counter() - t0
        except Exception as exc:
            raise StepFailed([], scheduled, exc) from exc
        self.stats.steps += 1
        self.stats.count_computed(scheduled)
        for seq, n in scheduled:  # their keys and values are in the cache now
            seq.num_computed_tokens += n
        self.kv.note_prefix_hits(plan)
        if self.stats.steps % 32 == 1:  # a mean over the worker's life: a sample now and then (it walks every block)
            self.stats.observe_slot_utilization(self.kv_usage()["slot_utilization"])
        outputs = self._finish_pooled(pool, scheduler) if pool is not None else []
        if not samplers:
            return outputs, None
        try:
            rows, logits = self._sampling_rows(logits, samplers, scheduler)
            # per-row questions asked with C-level maps: a step has hundreds of rows
            verifying = any(map(_DRAFT, samplers))
            offsets = verifier.row_offsets(rows) if verifying else [0] * len(rows)
            matchers = list(map(_MATCHER, rows))
            constrained = [i for i, m in enumerate(matchers) if m is not None] if matchers.count(None) < len(rows) \
                else []
            ahead = [rows[i].draft[:offsets[i]] for i in constrained] if verifying else None
            mask = (constrained, grammar.fill_bitmask([rows[i].matcher for i in constrained],
                                                      self.grammars.vocab_size, ahead)) if constrained else None
            plain = mask is None and all(map(_PLAIN_GREEDY, rows))  # no row needs its SampleRow
            sample_rows = None if plain else [self._sample_row(s, j) for s, j in zip(rows, offsets)]
            draw = self.runner.sample(logits, sample_rows, mask)
        except Exception as exc:
            raise StepFailed(outputs, [item for item in scheduled if item[0].request.params.embedding is None],
                              exc) from exc
        return outputs, LaunchedStep(rows, draw, scheduler, forked=len(rows) != len(samplers) and not verifying,
                                     verifying=verifying)

    def _resolve(self, launched: LaunchedStep | None) -> list[RequestOutput]:
        """Read a launched step's tokens and finish its rows: the tokens join their sequences, stops are found."""
        if launched is None:
            return []
        jobs = self.speculation.jobs
        if jobs is not None and jobs.pending:  # the job index's feeds, in time the host would wait for the device
            jobs.catch_up(lambda: not launched.draw.ready())
        sampled = launched.draw.result()
        rows, verified = launched.rows, []
        if launched.verifying:  # drafts judged: the accepted tokens and the bonus stand, the rest go
            rows, sampled, verified = verifier.settle(rows, sampled, self.block_manager)
            self._count_verified(verified)
        deferred = False
        for seq in rows:
            if seq.inflight:
                seq.inflight, seq.finishing, deferred = 0, False, True
        outputs = self._finish_rows(rows, sampled, None if deferred else launched.scheduler)
        for seq, _, _ in verified:  # blocks its accepted tokens filled are named now they are known
            if not seq.is_finished and seq.block_table:
                self.block_manager.name_resolved(seq)
        if self.speculation.draft_model is not None:  # a finished sequence's draft cache goes at once
            for seq in rows:
                if seq.is_finished:
                    self.speculation.release(seq)
        if deferred:
            bs = self.block_manager.block_size
            for seq in launched.rows:
                if seq.status is _FINISHED:
                    self._swapped_kv.pop(seq.seq_id, None)
                elif len(seq.token_ids) // bs > len(seq.block_hashes) and seq.block_table:
                    self.block_manager.name_resolved(seq)
        return outputs

    def _count_verified(self, verified: list[tuple[Sequence, int, int]]) -> None:
        for seq, drafted, accepted in verified:
            seq.spec.observe(drafted, accepted)
            self.speculation.rollback(seq, accepted)
            self.stats.count_verified(drafted, accepted, seq.spec.from_job)

    def _finish_pooled(self, pool: pooling.PoolRows, scheduler: Scheduler) -> list[RequestOutput]:
        """Embeddings inputs whose last chunk ran are done: their blocks go, no token is sampled."""
        outputs = []
        for seq in pool.seqs:
            request = seq.request
            if seq.num_computed_tokens < seq.num_tokens or request.request_id not in self.requests:
                continue
            try:
                seq.pooled = pooling.vector(seq, self.runner.pooling, request.params.embedding.dimensions)
                seq.finish_reason = "stop"
                scheduler.finish(seq)
                if request.is_finished:
                    outputs.append(self._output(request))
            except Exception as exc:
                log.exception("request %s failed while finishing its embedding", request.request_id)
                outputs.append(self._fail(request, exc))
        return outputs

    def _sampling_rows(self, logits: torch.Tensor, samplers: list[Sequence],
                       scheduler: Scheduler) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences to sample, in row order (an n > 1 request forks once its prompt is computed)."""
        if max(map(_SAMPLES, samplers)) == 1:  # no request of n > 1 samples: one row a sequence
            return samplers, logits
        rows: list[Sequence] = []
        row_of: list[int] = []
        for i, seq in enumerate(samplers):
            family = [seq] + (self._fork_if_due(seq, scheduler) if not seq.draft else [])
            rows += family
            row_of += [i] * len(family)
        if len(row_of) != len(samplers):
            logits = logits[torch.tensor(row_of, device=logits.device)]
        return rows, logits

    def _finish_rows(self, rows: list[Sequence], sampled, scheduler: Scheduler | None) -> list[RequestOutput]:
        """The sampled tokens join their sequences; ``scheduler`` None: each request's own (``_home``: an
        overlapped step's rows are read a step later, when a request may have moved)."""
        outputs = []
        now, requests, max_len = time.perf_counter(), self.requests, self.max_model_len
        tenants: list[str] = []  # a row's tenant per token: counted at once below
        lasts: tuple[list[float], list[float]] = ([], [])  # per class, each token's previous token's time
        rotating = self.long_rope_from is not None
        for seq, token, logprob in zip(rows, sampled.token_ids, sampled.logprobs):
            request = seq.request
            if seq.status is _FINISHED or request.request_id not in requests:  # ended before, failed or aborted
                continue
            last, seq.last_token_time = seq.last_token_time, now
            if last is not None:
                lasts[request.interactive].append(last)
            elif request.first_token_time is None:  # a fork's first token is its parent's
                request.first_token_time = now
                self.latencies.first_token.append((CLASSES[request.interactive], now - request.arrival_time))
            try:
                tokens = seq.token_ids
                tokens.append(token)
                if seq.counts is not None:
                    seq.counts.add(token)
                if seq.matcher is not None:
                    grammar.accept(seq.matcher, token, self.grammars.vocab_size)
                if logprob is not None:
                    seq.logprobs.append({"token_id": token, **logprob})
                tenants.append(request.tenant)
                if may_finish(seq, token, max_len):
                    seq.finish_reason = self._finish_reason(seq, token)
                if seq.finish_reason:
                    (scheduler or self._home(request)).finish(seq)
                    if request.is_finished:
                        outputs.append(self._output(request))
                elif rotating and not seq.long_rope and long_rope(self.long_rope_from, seq.num_tokens):
                    self._rotate_long(seq, scheduler or self._home(request))
            except Exception as exc:
                log.exception("request %s failed while finishing its token", request.request_id)
                outputs.append(self._fail(request, exc))
        if tenants:
            self.stats.output_tokens += len(tenants)
            self.stats.output_tokens_by_tenant.update(tenants)
        gaps = self.latencies.between_tokens
        for interactive, times in enumerate(lasts):
            for last, n in Counter(times).items():  # a step's rows mostly share their previous token's time
                gaps[CLASSES[interactive], now - last] += n
        return outputs

    def _step_failed(self, scheduled: list[tuple[Sequence, int]], scheduler: Scheduler,
                     exc: Exception) -> list[RequestOutput]:
        """Set the failed step's requests back to recompute; fail a lone one, else try them in halves."""
        culprit = self.isolation.step_failed(scheduled, scheduler, exc)
        return [] if culprit is None else [self._fail(culprit, exc)]

    def _fail(self, request: Request, exc: Exception, rejected: bool = False) -> RequestOutput:
        self.abort(request.request_id)
        return RequestOutput(request.request_id, request.prompt_token_ids, [],
                             error=f"{type(exc).__name__}: {exc}"[:2000],
                             rejected=isinstance(exc, (RequestRejected, grammar.GrammarDeadEnd)) or rejected)

    def _fork_if_due(self, seq: Sequence, scheduler: Scheduler) -> list[Sequence]:
        """When an n > 1 request's prompt is computed, its other samples share the prompt's blocks."""
        request = seq.request
        if request.params.n == 1 or len(request.sequences) > 1:
            return []
        children = []
        for i in range(1, request.params.n):
            child = self._new_sequence(request, i, list(seq.token_ids))
            if request.grammar is not None:
                child.matcher = grammar.new_matcher(request.grammar, child.output_token_ids)
            self.block_manager.fork(seq, child)
            scheduler.add_running(child)
            children.append(child)
        return children

    def _rotate_long(self, seq: Sequence, scheduler: Scheduler) -> None:
        """A longrope sequence that has just passed the threshold is computed again, all of it, with the
        long factors: transformers' Phi-3 drops its cache and does the same (``worker.model.rotary``)."""
        scheduler.remove(seq)
        seq.long_rope, seq.block_hashes = True, []
        scheduler.add(seq)

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        """Sample ``index`` of a generation, or input ``index`` of an embeddings request (its own prompt)."""
        prompt = len(token_ids) if request.params.embedding is not None else len(request.prompt_token_ids)
        seq = Sequence(request=request, sample_index=index, token_ids=token_ids, num_prompt_tokens=prompt,
                       long_rope=long_rope(self.long_rope_from, len(token_ids)))
        request.sequences.append(seq)
        return seq

    def _sample_row(self, seq: Sequence, offset: int = 0) -> SampleRow:
        """A constrained row's EOS is never suppressed for ``min_tokens``: its grammar says where it ends.
        A penalised row's token counts are built from its tokens when first needed (also after a
        resume or a fork), then kept up to date by ``_finish_rows``. ``offset``: the row after a verified
        sequence's ``offset``-th draft token, sampled as that position (worker/engine/speculative/)."""
        if seq.counts is None and seq.request.params.penalized:
            seq.counts = TokenCounts.of(seq.token_ids, seq.num_prompt_tokens)
        counts = seq.counts.extended(seq.draft[:offset]) if offset and seq.counts is not None else seq.counts
        return SampleRow(seq.request.params, seq.sample_index, seq.num_tokens + offset,
                         seq.num_output_tokens + offset, seq.request.stop_ids if seq.matcher is None else (),
                         counts)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        return stop_checker.finish_reason(seq, token, self.tokenizer, self.max_model_len)

    def final_text(self, seq: Sequence) -> str:
        """A finished sample's text, as its result shows it (``stop_checker.final_text``)."""
        return stop_checker.final_text(seq, self.tokenizer)

    def _output(self, request: Request) -> RequestOutput:
        del self.requests[request.request_id]
        self.stats.requests_finished += 1
        if request.params.embedding is not None:
            vectors = torch.stack([seq.pooled for seq in sorted(request.sequences, key=lambda s: s.sample_index)])
            vectors = vectors.to("cpu", torch.float32).numpy()  # plain data: it crosses to the ledger's process
            return RequestOutput(request.request_id, request.prompt_token_ids, [], embeddings=vectors,
                                 embedding=request.params.embedding)
        jobs = self.speculation.jobs
        if jobs is not None and request.job is not None:  # its samples' outputs, for its job's later requests
            for seq in request.sequences:
                jobs.feed(request.tenant, request.job, seq.token_ids, seq.num_prompt_tokens)
        later = request.text_later
        completions = [Completion(seq.sample_index, seq.output_token_ids, None if later else self.final_text(seq),
                                  seq.finish_reason, seq.logprobs if request.params.logprobs is not None else None,
                                  stop_checker.shown_tokens(seq), seq.stop_text_end)
                       for seq in request.sequences]
        return RequestOutput(request.request_id, request.prompt_token_ids, completions,
                             num_cached_prompt_tokens=request.cached_prompt_tokens or 0)

    # ---- whole batches
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in input order."""
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
            self.add_request(Request(str(i), list(ids), p))
        results: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), unit="req", dynamic_ncols=True)
        while self.has_unfinished():
            done = self.step()
            for out in done:
                results[out.request_id] = out
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [results[str(i)] for i in range(len(prompts))]

    # ---- observability
    def kv_usage(self) -> dict:
        """Blocks used and free, and the share of used blocks' slots that hold a computed token."""
        bm = self.block_manager
        return {"blocks_used": bm.num_used_blocks, "blocks_free": bm.num_free_blocks,
                "blocks_total": bm.num_blocks, "kv_bytes": self.runner.kv_bytes,
                "slot_utilization": bm.slot_utilization([*self.scheduler.running, *self.isolation.apart.running])}


def _fit_drafts(drafts: Drafts, plan: SchedulerOutput, blocks: BlockManager) -> None:
    """Cut each draft to what the scheduler gave its sequence this step (a budget's end, room in the cache)
    and to what its grammar allows, and then the longest ones so that the step's rows are a bucket's
    (``policy.excess_rows``), with the blocks given for the rest; drop the drafts of sequences it did not run."""
    given = {seq: n for seq, n in plan.scheduled if seq.draft}
    for seq in drafts.seqs:
        if seq.status is not SeqStatus.RUNNING or seq not in given:
            seq.draft = []
            continue
        del seq.draft[seq.num_computed_tokens + given[seq] - len(seq.token_ids):]
        if seq.matcher is not None:  # a draft ends at the first token its grammar refuses
            del seq.draft[grammar.allowed_prefix(seq.matcher, seq.draft):]
    drafted = sorted((seq for seq in drafts.seqs if seq.draft), key=lambda seq: -len(seq.draft))
    excess = excess_rows(plan.num_tokens, sum(len(seq.draft) for seq in drafted))  # each n is its seq's now
    for seq in drafted:
        cut = min(excess, len(seq.draft))
        del seq.draft[len(seq.draft) - cut:]
        excess -= cut
    for i, (seq, n) in enumerate(plan.scheduled):
        if seq in given:
            n = len(seq.token_ids) + len(seq.draft) - seq.num_computed_tokens
            plan.scheduled[i] = (seq, n)
            blocks.trim(seq, seq.num_computed_tokens + n)


def describe_model(config) -> str:
    """'llama, 30 layers, hidden 576, context 8192 tokens': what a log line says of a model."""
    return (f"{getattr(config, 'model_type', '?')}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"context {context_length(config)} tokens")


def _eos_ids(config, tokenizer, path: str) -> tuple[int, ...]:
    """Every id that ends a completion: the config's, the tokenizer's, and generation_config.json's
    where the model folder has one (Llama 3 and Qwen list their end-of-turn tokens there)."""
    generation = Path(path) / "generation_config.json"
    try:
        from_generation = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring %s: %s", generation, exc)
        from_generation = None
    ids = set()
    for value in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None), from_generation):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))
