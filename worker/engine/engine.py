"""The engine: requests in at any moment, one scheduled step at a time, finished requests out.

    engine = Engine(Settings(dtype="bfloat16"))
    engine.add_request(Request("a", prompt_token_ids, SamplingParams(max_tokens=64)))
    while engine.has_unfinished():
        for output in engine.step():
            ...

A request's life: ``add_request`` queues its first sequence; ``step`` asks the scheduler for a
token budget's worth of work, moves KV blocks it asked for (copy-on-write, swap), runs the model
on one flattened batch, samples every sequence that reached the end of its tokens, and hands back
the requests whose every sample has finished. ``abort`` drops a request at once.

A request with a structured output (``SamplingParams.structured``) first waits, outside the
scheduler (no running slot, no KV blocks), for its grammar to compile in its tenant's turn in the
compile pool (worker/engine/structured/grammar_pool.py, which stops a compile at its deadline); then each of its samples gets a matcher, the step masks the constrained rows' logits, and a
sample whose grammar is complete finishes with "stop". A spec that does not compile, or resumed
tokens its grammar refuses, fails that request alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from worker.config import Settings
from worker.engine import pooling
from worker.engine.structured import grammar
from worker.engine.block_manager import BlockManager
from worker.engine.penalties import TokenCounts
from worker.engine.model_runner import ModelRunner
from worker.engine.request import Completion, Request, RequestOutput, SamplingParams, SeqStatus, Sequence
from worker.engine.sampler import SampleRow, sample
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.step_pace import StepPace
from worker.model.architectures import context_length
from worker.model.base import LoadedModel
from worker.model.loader import load_model
from worker.model.rotary import long_rope, long_rope_from
from worker.process_clock import seconds_since_start

log = logging.getLogger("berth.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SampleState:
    """One sample of a running request, as a checkpoint needs it."""

    sample_index: int
    output_token_ids: list[int]
    block_hashes: list[bytes]  # content addresses of its computed full blocks, in order
    block_ids: list[int]  # where those blocks are now (valid until the next step)


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]  # empty until the prompt is computed (and n samples exist)


@dataclass
class SharedPrefix:
    """Leading blocks of a request's prompt that it found in the prefix cache: a prefix that more than
    one request has used, worth offering to other workers (``worker.checkpoint.prefix_store``)."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[int]  # where those blocks are now (valid until the next step)


class RequestRejected(ValueError):
    """A request the engine can never run (too long for the model or the KV cache)."""


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

    def observe_slot_utilization(self, value: float) -> None:
        self.slot_utilization_sum += value
        self.slot_utilization_count += 1

    @property
    def mean_slot_utilization(self) -> float:
        n = self.slot_utilization_count
        return self.slot_utilization_sum / n if n else 0.0


CLASSES = ("batch", "interactive")  # a request's class, by ``Request.interactive``


@dataclass
class StepLatencies:
    """What one ``Engine.step`` measured for a reader of metrics (``Engine.latencies``, new every step):
    the time to first token of each request that got its first, and the times between a sequence's
    token and the one before, each with how many sequences had it (those of a step mostly share one)."""

    first_token: list[tuple[str, float]] = field(default_factory=list)  # (class, seconds since arrival)
    between_tokens: Counter[tuple[str, float]] = field(default_factory=Counter)  # (class, seconds) -> tokens


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
        self.runner = ModelRunner(loaded, dtype=dtype, device=self.device, block_size=settings.block_size,
                                  kv_memory=settings.kv_memory, attention_backend=settings.attention_backend,
                                  max_seqs=settings.max_num_seqs, max_model_len=self.max_model_len,
                                  kv_cache_dtype=settings.kv_cache_dtype, weight_dtype=settings.weight_dtype)
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
                                   interactive_step_tokens=self.pace.tokens)
        # Requests marked ``Request.isolated`` (a worker's crash suspects) are scheduled here instead, over
        # the same KV cache; while any is in the engine, only they step (``_isolated_step``).
        self._apart = self._side_scheduler()
        self.eos_token_ids = _eos_ids(loaded.config, self.tokenizer, loaded.path)
        self.vocab_size = loaded.config.vocab_size
        self.hidden_size = loaded.config.hidden_size  # an embedding's length before ``dimensions`` cuts it
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.latencies = StepLatencies()
        self._swapped_kv: dict[int, torch.Tensor] = {}
        self._probation: list[list[Request]] = []  # suspects of a failed step, in groups to step alone
        self._compiling: list[Request] = []  # waiting for their grammar, outside the scheduler
        self.watch_shared_prefixes = False  # keep ``SharedPrefix``es for ``take_shared_prefixes``
        self._shared: list[SharedPrefix] = []
        # Told the ids of requests about to run for the first time, before the step that runs them: a
        # worker that dies in that step has said which requests it was running (poison counts them).
        self.on_start: Callable[[list[str]], None] | None = None
        log.info("engine ready (%.1fs since the process started)", seconds_since_start())

    # ---- requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in the engine")
        p = request.params
        if p.embedding is not None:
            self._check_embedding(request)
        else:
            total = len(request.prompt_token_ids) + p.max_tokens
            self._check_fits(total, f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({p.max_tokens})",
                             f"prompt + max_tokens ({total} tokens)", request.interactive)
        self._check_tokens(request)
        request.stop_ids = (() if p.ignore_eos else self.eos_token_ids) + tuple(p.stop_token_ids)
        request.stop_set = frozenset(request.stop_ids)
        request.arrival_step = self.scheduler.step_count
        if request.arrival_time is None:
            request.arrival_time = time.perf_counter()
        request.sequences = []
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
            request.grammar_future = self.grammars.submit(p.structured, request.tenant,
                                                          grammar.CompileRules.of(self.settings))
            self._compiling.append(request)
            return
        for seq in request.sequences:
            self._home(request).add(seq)

    def _check_fits(self, tokens: int, as_context: str, as_cache: str, interactive: bool) -> None:
        """A sequence of ``tokens`` must fit the model's context and the whole KV cache, a batch one the
        part of it batch work may hold (``Settings.interactive_kv_blocks``); the refusal names it as
        ``as_context`` or ``as_cache``."""
        if tokens > self.max_model_len:
            raise RequestRejected(f"{as_context} exceeds the model's context of {self.max_model_len} tokens")
        capacity = self.runner.num_blocks * self.block_manager.block_size
        if tokens > capacity:
            raise RequestRejected(f"{as_cache} exceeds the whole KV cache ({capacity} tokens): raise --kv-memory")
        batch = (self.runner.num_blocks - self.scheduler.interactive_blocks) * self.block_manager.block_size
        if not interactive and tokens > batch:
            raise RequestRejected(f"{as_cache} exceeds the part of the KV cache batch work may hold ({batch} "
                                  "tokens; --interactive-kv-blocks holds the rest): raise --kv-memory")

    def _check_embedding(self, request: Request) -> None:
        """Each input runs as a sequence of its own: each must fit the context and the KV cache."""
        p, longest = request.params, max(request.params.embedding.lengths)
        self._check_fits(longest, f"an input of {longest} tokens", f"an input of {longest} tokens", request.interactive)
        dims = p.embedding.dimensions
        if dims is not None and dims > self.hidden_size:
            raise RequestRejected(f"dimensions {dims} exceeds the model's hidden size {self.hidden_size}")
        if p.structured is not None or request.resume_output_ids:
            raise RequestRejected(f"request {request.request_id}: an embeddings request samples nothing: it takes "
                                  "no structured output and resumes from no checkpoint")

    @functools.cached_property
    def grammars(self) -> grammar.Compiler:
        """Structured outputs' compiler for this model's tokenizer, logits width and EOS (built on first use)."""
        return grammar.compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar compiled join the scheduler, a matcher per sample (past the tokens a
        resumed sample has); those whose grammar failed are failed with the reason (one past its
        deadline among them: the compile pool stops it and fails its future)."""
        scheduled = self._apart.has_work() if self._isolating() else self.scheduler.has_work()
        if self._compiling and not scheduled and not self._probation:
            wait([r.grammar_future for r in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        outputs, pending, self._compiling = [], self._compiling, []
        for request in pending:
            if not request.grammar_future.done():
                self._compiling.append(request)
                continue
            try:
                request.grammar = request.grammar_future.result()
                for seq in request.sequences:
                    seq.matcher = grammar.new_matcher(request.grammar, seq.output_token_ids)
            except Exception as exc:  # noqa: BLE001 (this request's spec: it fails alone)
                outputs.append(self._fail(request, exc))
                continue
            for seq in request.sequences:
                self._home(request).add(seq)
        return outputs

    def _check_tokens(self, request: Request) -> None:
        """What the model cannot run is refused here, whoever let it through: token ids out of the
        vocabulary (a negative one would index from its end), resumed outputs longer than allowed."""
        p, vocab = request.params, self.vocab_size
        for what, ids in (("prompt", request.prompt_token_ids), ("stop_token_ids", p.stop_token_ids),
                          ("logit_bias", [t for t, _ in p.logit_bias]),
                          *((f"resumed sample {i}", out) for i, out in enumerate(request.resume_output_ids))):
            if ids and not (0 <= min(ids) and max(ids) < vocab):
                raise RequestRejected(f"request {request.request_id}: {what} has token ids outside [0, {vocab})")
        for i, out in enumerate(request.resume_output_ids):
            if len(out) >= p.max_tokens:
                raise RequestRejected(f"request {request.request_id}: resumed sample {i} has {len(out)} tokens, "
                                      f"max_tokens is {p.max_tokens}")
        if p.top_k > vocab:
            raise RequestRejected(f"request {request.request_id}: top_k {p.top_k} exceeds the vocabulary ({vocab})")

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
        return True

    def set_tenant_share(self, tenant: str, share: float) -> None:
        """Weight of ``tenant`` in each step's tokens and in running seats: with shares 2 and 1, twice
        the tokens while both have work (the scheduler's turns, worker/engine/fair_share.py)."""
        if share <= 0:
            raise ValueError("a tenant's share must be positive")
        self.scheduler.shares[tenant] = share

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- checkpoints
    def request_state(self, request_id: str) -> RequestState | None:
        """What a checkpoint of a request holds: its tokens so far and its computed full blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        samples = []
        if len(request.sequences) == request.params.n and request.params.embedding is None:
            bs = self.block_manager.block_size
            for seq in request.sequences:
                full = seq.num_computed_tokens // bs if seq.block_table else 0
                self.block_manager.hash_full_blocks(seq, full * bs)
                samples.append(SampleState(seq.sample_index, list(seq.output_token_ids),
                                           list(seq.block_hashes[:full]), list(seq.block_table[:full])))
        return RequestState(request_id, list(request.prompt_token_ids), request.params, samples)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``."""
        return self.runner.read_blocks(block_ids)

    def load_kv_blocks(self, block_hashes: list[bytes], data: torch.Tensor) -> int:
        """Put restored blocks into the prefix cache, where a resumed request finds them instead of
        recomputing; returns how many were loaded (cached ones and those without room are skipped)."""
        targets = [(i, self.block_manager.insert_cached(h)) for i, h in enumerate(block_hashes)]
        targets = [(i, b) for i, b in targets if b is not None]
        if targets:
            self.runner.write_blocks([b for _, b in targets], data[:, :, [i for i, _ in targets]])
        return len(targets)

    def prefix_block_hashes(self, request: Request) -> list[bytes]:
        """The names of the full blocks of ``request``'s prompt that admitting it could take from the
        prefix cache (all but the block of its last token), as the block manager will name them."""
        seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids),
                       long_rope=long_rope(self.long_rope_from, len(request.prompt_token_ids)))
        self.block_manager.hash_full_blocks(seq, seq.num_tokens - 1)
        return seq.block_hashes

    def cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the prefix cache holds now."""
        if not self.block_manager.enable_prefix_cache:
            return 0
        cached = self.block_manager.cached
        return next((i for i, h in enumerate(block_hashes) if h not in cached), len(block_hashes))

    def take_shared_prefixes(self) -> list[SharedPrefix]:
        """The prefixes requests found in the prefix cache since the last call (with
        ``watch_shared_prefixes`` on); call between steps."""
        shared, self._shared = self._shared, []
        return shared

    @functools.cached_property
    def fingerprint(self) -> str:
        """Names the KV cache's meaning: model files, dtype, KV cache dtype, weight dtype and block size. Checkpointed
        blocks are reused only under the same fingerprint."""
        h = hashlib.sha256()
        path = Path(self.model_path)
        for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:  # the head and tail of each file: cheap, and different per model
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
        h.update(f"{self.settings.dtype}:{self.settings.block_size}".encode())
        if self.settings.kv_cache_dtype != "auto":  # "auto" hashes as before: its checkpoints stay valid
            h.update(f":kv={self.settings.kv_cache_dtype}".encode())
        if self.settings.weight_dtype != "auto":  # int8 weights compute other keys and values than exact ones
            h.update(f":weights={self.settings.weight_dtype}".encode())
        return h.hexdigest()[:32]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self._apart.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: never admitted, preempted, swapped out, or suspects of a failed step."""
        suspects = sum(1 for group in self._probation for r in group for seq in r.sequences if not seq.is_finished)
        compiling = sum(len(r.sequences) for r in self._compiling)
        apart = len(self._apart.waiting)
        return len(self.scheduler.waiting) + len(self.scheduler.swapped) + suspects + compiling + apart

    # ---- the step
    def step(self) -> list[RequestOutput]:
        """One scheduled step; the requests it finished (or failed, with ``RequestOutput.error``).

        Blast radius of one: when running a step raises, the step's requests are suspects. They are
        set back to recompute (their tokens, logprobs and draws kept, so their text is unchanged) and
        tried again in halves, each half in a step of its own (``_probation``) before the rest of
        the engine steps again; a suspect that fails a step alone is the culprit, failed with the
        error. An error while finishing one row (stop strings, detokenising) fails that request.

        Isolation: while a request marked ``Request.isolated`` is in the engine, each step runs only
        isolated requests (``_isolated_step``); the others wait where they are, until ``release``
        (or their end) takes the last isolated one out. A worker runs the requests that were running
        when a worker died so, apart from all other work, to tell which of them kills a worker.
        """
        self.latencies = StepLatencies()
        outputs = self._admit_compiled() if self._compiling else []
        if self._probation:
            return outputs + self._probe_step()
        if self._isolating():
            return outputs + self._isolated_step()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs += self._run(plan, self.scheduler)
        self.pace.observe(plan, time.perf_counter() - t0)
        self.scheduler.interactive_step_tokens = self.pace.tokens
        return outputs

    # ---- isolation
    def release(self, request_id: str) -> None:
        """An isolated request rejoins the others: it runs in ordinary steps from now on (its blocks kept)."""
        request = self.requests.get(request_id)
        if request is None or not request.isolated:
            return
        request.isolated = False
        for seq in request.sequences:
            if seq in self._apart.running:
                self._apart.running.remove(seq)
                self.scheduler.add_running(seq)
            elif seq in self._apart.waiting:
                self._apart.waiting.remove(seq)
                self.scheduler.add(seq)

    def _isolating(self) -> bool:
        return self._apart.has_work() or any(r.isolated for r in self._compiling)

    def _home(self, request: Request) -> Scheduler:
        """The scheduler a request's sequences belong to."""
        return self._apart if request.isolated else self.scheduler

    def _side_scheduler(self) -> Scheduler:
        """A scheduler over the engine's KV cache for a few requests stepped apart from the rest."""
        s = self.settings
        return Scheduler(self.block_manager, s.max_num_batched_tokens, s.max_num_seqs, s.aging_steps, "recompute")

    def _isolated_step(self) -> list[RequestOutput]:
        """A step of the isolated requests alone. The others keep their blocks while they wait, unless
        the isolated ones cannot get one without them: then the others' newest are preempted (recomputed
        when they run again), one at a time, until an isolated one fits."""
        apart = self._apart
        if not apart.has_work():
            return []  # isolated ones still compiling their grammar (``_admit_compiled`` waited for it)
        plan = apart.schedule()
        while not plan.scheduled and apart.waiting and self.scheduler.running:
            main = self.scheduler
            victim = max(main.running, key=lambda seq: (-seq.priority, seq.admitted_order))
            main.running.remove(victim)
            self.block_manager.free_sequence(victim)
            main.add(victim)
            self.stats.preemptions += 1
            plan = apart.schedule()
        return self._run(plan, apart)

    def _run(self, plan: SchedulerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        self.stats.preemptions += len(plan.preempted)
        self.stats.prompt_tokens_cached += plan.num_cached_tokens
        for seq, blocks in plan.swap_out:
            self._swapped_kv[seq.seq_id] = self.runner.read_blocks(blocks)
        self.runner.copy_blocks(plan.copies)
        for seq, blocks in plan.swap_in:
            self.runner.write_blocks(blocks, self._swapped_kv.pop(seq.seq_id))
        if not plan.scheduled:
            return []
        fresh = [seq.request for seq, _ in plan.scheduled if not seq.request.started]
        if fresh:
            for request in fresh:
                request.started = True
            if self.on_start is not None:
                self.on_start(list(dict.fromkeys(r.request_id for r in fresh)))
        scheduled = sorted(plan.scheduled, key=lambda item: item[1] != 1)  # decodes first
        try:
            step_input, samplers, pool = self.runner.prepare(scheduled)
            t0 = time.perf_counter()
            logits, pooled = self.runner.execute(step_input)
            if pool is not None:
                pooling.pool_step(pool, pooled, self.runner.pooling)
            self.stats.forward_seconds += time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 (whatever a request made the step raise: find it, fail it alone)
            return self._step_failed(scheduled, scheduler, exc)
        self.stats.steps += 1
        by_class = [0, 0, 0, 0]  # batch prompt, batch output, interactive prompt, interactive output
        for seq, n in scheduled:  # their keys and values are in the cache now
            prompt = self._count_computed(seq, n)
            k = 2 * seq.request.interactive
            by_class[k] += prompt
            by_class[k + 1] += n - prompt
            seq.num_computed_tokens += n
        for k, n in enumerate(by_class):
            if n:
                self.stats.computed_tokens[CLASSES[k >> 1], ("prompt", "output")[k & 1]] += n
        if self.watch_shared_prefixes:  # prompt blocks found, not a resumed request's own restored ones
            bs = self.block_manager.block_size
            for seq, n in plan.prefix_hits:
                n = min(n, seq.num_prompt_tokens // bs)
                if n and not seq.request.resume_output_ids and not seq.request.interactive:
                    self._shared.append(SharedPrefix(seq.request.request_id, seq.block_hashes[:n],
                                                     seq.block_table[:n]))
        if self.stats.steps % 8 == 1:
            self.stats.observe_slot_utilization(self.kv_usage()["slot_utilization"])
        outputs = self._finish_pooled(pool, scheduler) if pool is not None else []
        if not samplers:
            return outputs
        try:
            rows, logits = self._sampling_rows(logits, samplers, scheduler)
            constrained = [i for i, seq in enumerate(rows) if seq.matcher is not None]
            mask = (constrained, grammar.fill_bitmask([rows[i].matcher for i in constrained],
                                                      self.grammars.vocab_size)) if constrained else None
            sampled = sample(logits, [self._sample_row(s) for s in rows], mask)
        except Exception as exc:  # noqa: BLE001
            return outputs + self._step_failed([item for item in scheduled if item[0].request.params.embedding is None],
                                               scheduler, exc)
        return outputs + self._finish_rows(rows, sampled, scheduler)

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
            except Exception as exc:  # noqa: BLE001 (this input's own: its request fails alone)
                log.exception("request %s failed while finishing its embedding", request.request_id)
                outputs.append(self._fail(request, exc))
        return outputs

    def _sampling_rows(self, logits: torch.Tensor, samplers: list[Sequence],
                       scheduler: Scheduler) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences to sample, in row order (an n > 1 request forks once its prompt is computed)."""
        rows: list[Sequence] = []
        row_of: list[int] = []
        for i, seq in enumerate(samplers):
            family = [seq] + self._fork_if_due(seq, scheduler)
            rows += family
            row_of += [i] * len(family)
        if len(row_of) != len(samplers):
            logits = logits[torch.tensor(row_of, device=logits.device)]
        return rows, logits

    def _finish_rows(self, rows: list[Sequence], sampled, scheduler: Scheduler) -> list[RequestOutput]:
        outputs = []
        now, gaps = time.perf_counter(), self.latencies.between_tokens
        for seq, token, logprob in zip(rows, sampled.token_ids, sampled.logprobs):
            request = seq.request
            if request.request_id not in self.requests:  # failed by an earlier row of this step
                continue
            last, seq.last_token_time = seq.last_token_time, now
            if last is not None:
                gaps[CLASSES[request.interactive], now - last] += 1
            elif request.first_token_time is None:  # a fork's first token is its parent's
                request.first_token_time = now
                self.latencies.first_token.append((CLASSES[request.interactive], now - request.arrival_time))
            try:
                seq.token_ids.append(token)
                if seq.counts is not None:
                    seq.counts.add(token)
                if seq.matcher is not None:
                    grammar.accept(seq.matcher, token, self.grammars.vocab_size)
                if logprob is not None:
                    seq.logprobs.append({"token_id": token, **logprob})
                self.stats.output_tokens += 1
                self.stats.output_tokens_by_tenant[request.tenant] += 1
                seq.finish_reason = self._finish_reason(seq, token)
                if seq.finish_reason:
                    scheduler.finish(seq)
                    if request.is_finished:
                        outputs.append(self._output(request))
                elif not seq.long_rope and long_rope(self.long_rope_from, seq.num_tokens):
                    self._rotate_long(seq, scheduler)
            except Exception as exc:  # noqa: BLE001 (this row's own: it fails alone)
                log.exception("request %s failed while finishing its token", request.request_id)
                outputs.append(self._fail(request, exc))
        return outputs

    def _step_failed(self, scheduled: list[tuple[Sequence, int]], scheduler: Scheduler,
                     exc: Exception) -> list[RequestOutput]:
        """Set the failed step's requests back to recompute; fail a lone one, else try them in halves."""
        suspects = list({seq.request.request_id: seq.request for seq, _ in scheduled}.values())
        for request in suspects:
            self._set_back(request, scheduler)
        if len(suspects) == 1:
            log.warning("request %s failed a step of its own: %s: %s", suspects[0].request_id, type(exc).__name__, exc)
            return [self._fail(suspects[0], exc)]
        log.warning("a step of %d requests failed (%s: %s); trying them again in halves to find the cause",
                    len(suspects), type(exc).__name__, exc)
        half = len(suspects) // 2
        self._probation[:0] = [suspects[:half], suspects[half:]]
        return []

    def _set_back(self, request: Request, scheduler: Scheduler) -> None:
        """Out of ``scheduler``, blocks freed, as if preempted for recompute; blocks that the failed step
        was to fill are no longer findable in the prefix cache."""
        for seq in request.sequences:
            if seq.is_finished:
                continue
            self.block_manager.forget_uncomputed(seq)
            scheduler.remove(seq)
            self._swapped_kv.pop(seq.seq_id, None)
            seq.status = SeqStatus.WAITING

    def _probe_step(self) -> list[RequestOutput]:
        """A step of one group of suspects alone; those it ran rejoin the engine, the rest wait their turn."""
        group = [r for r in self._probation.pop(0) if r.request_id in self.requests]
        if not group:
            return []
        probe = self._side_scheduler()
        for request in group:
            for seq in request.sequences:
                if not seq.is_finished:
                    probe.add(seq)
        plan = probe.schedule()
        outputs = self._run(plan, probe)
        for seq in list(probe.running):  # ran: back among the others (an isolated one: among the isolated)
            probe.running.remove(seq)
            self._home(seq.request).add_running(seq)
        untried = list({seq.request.request_id: seq.request for seq in probe.waiting}.values())
        if untried:
            if plan.scheduled:
                self._probation.insert(0, untried)
            else:  # no room to try them alone: back among the others
                for request in untried:
                    for seq in request.sequences:
                        if seq.status is SeqStatus.WAITING:
                            self._home(request).add(seq)
        return outputs

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        self.abort(request.request_id)
        return RequestOutput(request.request_id, request.prompt_token_ids, [],
                             error=f"{type(exc).__name__}: {exc}"[:2000],
                             rejected=isinstance(exc, (RequestRejected, grammar.GrammarDeadEnd)))

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

    def _sample_row(self, seq: Sequence) -> SampleRow:
        """A constrained row's EOS is never suppressed for ``min_tokens``: its grammar says where it ends.
        A penalised row's token counts are built from its tokens when first needed (also after a
        resume or a fork), then kept up to date by ``_finish_rows``."""
        if seq.counts is None and seq.request.params.penalized:
            seq.counts = TokenCounts.of(seq.token_ids, seq.num_prompt_tokens)
        return SampleRow(seq.request.params, seq.sample_index, seq.num_tokens, seq.num_output_tokens,
                         seq.request.stop_ids if seq.matcher is None else (), seq.counts)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.request.params
        if token in seq.request.stop_set and seq.num_output_tokens > p.min_tokens:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"
        if p.stop and self._cut_at_stop_string(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        """Whether the output now holds a stop string (and where the text ends). Checked after
        every token: only the last tokens are decoded (a new match ends in the newest token, and a
        character takes at most 4 byte tokens), and the whole output only to place a match, which
        ends the sequence; decoding it all every step would be quadratic in its length."""
        stops = seq.request.params.stop
        ids = seq.output_token_ids
        window = 4 * max(map(len, stops)) + 8
        if len(ids) > window:
            tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=True)
            if not any(s in tail for s in stops):
                return False
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            seq.stop_text_end = min(hits)
        return bool(hits)

    def final_text(self, seq: Sequence) -> str:
        """A finished sample's text, as its result shows it: without the stop token that ended it,
        cut where a stop string began."""
        ids = seq.output_token_ids
        shown = ids[:-1] if seq.finish_reason == "stop" and ids and ids[-1] in seq.request.stop_set else ids
        text = self.tokenizer.decode(shown, skip_special_tokens=True)
        return text if seq.stop_text_end is None else text[:seq.stop_text_end]

    def _output(self, request: Request) -> RequestOutput:
        del self.requests[request.request_id]
        self.stats.requests_finished += 1
        if request.params.embedding is not None:
            vectors = torch.stack([seq.pooled for seq in sorted(request.sequences, key=lambda s: s.sample_index)])
            return RequestOutput(request.request_id, request.prompt_token_ids, [], embeddings=vectors,
                                 embedding=request.params.embedding)
        completions = [Completion(seq.sample_index, seq.output_token_ids, self.final_text(seq), seq.finish_reason,
                                  seq.logprobs if request.params.logprobs is not None else None)
                       for seq in request.sequences]
        return RequestOutput(request.request_id, request.prompt_token_ids, completions,
                             num_cached_prompt_tokens=request.cached_prompt_tokens or 0)

    def _count_computed(self, seq: Sequence, n: int) -> int:
        """Count ``n`` tokens of ``seq`` computed; how many of them were its prompt's."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        prompt = max(0, min(end, seq.num_prompt_tokens) - start)
        self.stats.prompt_tokens_computed += prompt
        self.stats.recomputed_tokens += max(0, min(end, seq.num_tokens - 1) - max(start, seq.num_prompt_tokens))
        return prompt

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
        bs = self.block_manager.block_size
        filled: dict[int, int] = {}
        for seq in (*self.scheduler.running, *self._apart.running):
            for i, b in enumerate(seq.block_table):
                filled[b] = max(filled.get(b, 0), min(bs, seq.num_computed_tokens - i * bs))
        used = self.block_manager.num_used_blocks
        return {"blocks_used": used, "blocks_free": self.block_manager.num_free_blocks,
                "blocks_total": self.block_manager.num_blocks, "kv_bytes": self.runner.kv_bytes,
                "slot_utilization": sum(filled.values()) / (len(filled) * bs) if filled else 1.0}


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
