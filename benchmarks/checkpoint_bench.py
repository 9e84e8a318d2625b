"""What checkpoints cost and what they save, on the default model against an S3 endpoint.

Two measurements of the checkpoint issue, each optional (``--only``):

1. restore: for contexts of 256, 1k and 4k tokens, a request is run to that context with
   checkpoints on, its state and KV blocks are checked on the store, and it is resumed by the
   real ``Restorer`` in an engine whose prefix cache has been emptied, once reading its KV blocks
   back and once recomputing them by prefill, each timed from ``Restorer.submit`` to the next token
   (median of ``--repeats``, after one untimed try of each). Both must give the undisturbed run's
   next token. It prints which way the Restorer itself would choose at the rates it measured
   during the run (``Restorer.reads_blocks``), and at its start-up defaults. (Its checkpoints write
   every KV block, ``checkpoint_kv`` always, so that there are blocks to read back.)
2. overhead: the throughput benchmark's workload (``benchmarks/workload.py``), driven as the engine
   worker drives it (every request added, then steps, each followed by ``Checkpointer.after_step``
   and ``Restorer.observe_step``, and finished requests' checkpoints dropped), with checkpoints off
   and every ``--interval`` tokens (``--kv``: which KV blocks, berth's default "auto"), interleaved in
   ``--rounds`` (off then on, then on then off, ...) so that a busy machine slows both alike;
   medians of useful output tokens/s, their ratio, the PUTs (per second, per round, per 1,000
   tokens) and bytes written, the checkpoint lag, and the writer's superseded snapshots and failures.

The S3 endpoint is moto's server in a child process (in this process it would take the GIL from the
engine loop), unless ``--storage-url`` names another store (``s3://...`` with the AWS variables
set, or ``file:///folder``). Every run writes under a fresh prefix and deletes it afterwards.

    python benchmarks/checkpoint_bench.py --quick --rounds 2
    python benchmarks/checkpoint_bench.py --only restore --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info
from benchmarks.throughput import (
    WARMUP_PROMPTS,
    WARMUP_TOKENS,
    add_workload_options,
    berth_settings,
    clock,
    greedy_params,
    parse_workload_args,
    save_report,
    useful_timing,
)
from benchmarks.workload import Workload, corpus_token_ids, make_workload
from storage import ObjectStore, open_store
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.format import KV_PREFIX, SEGMENT_PREFIX, RequestCheckpoint, StateRef, decode_run, kv_key
from worker.checkpoint.resume import Restorer, TransferRates
from worker.checkpoint.writer import THREAD_NAME
from worker.config import Settings
from worker.engine.engine import DTYPES, Engine, EngineStats
from worker.engine.request import Request
from worker.metrics import WorkerMetrics
from worker.model.base import LoadedModel
from worker.model.loader import load_model

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
CONTEXTS = (256, 1024, 4096)
GENERATED = 32  # tokens a restore benchmark request has generated when it is "killed" (2 checkpoints at 16)
RESTORE_KV_MEMORY = "1GiB"
TARGET_RATIO = 0.95


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("restore", "overhead"), default=None, help="run one measurement")
    add_workload_options(parser)  # --requests / --quick: the overhead measurement's workload
    parser.add_argument("--storage-url", default="", help="s3://BUCKET/PREFIX or file:///FOLDER "
                        "(default: a moto S3 server started in a child process)")
    parser.add_argument("--interval", type=int, default=16, help="checkpoint every this many tokens (default: 16)")
    parser.add_argument("--kv", choices=("auto", "always", "never"), default="auto",
                        help="overhead: which KV blocks are written (berth's checkpoint_kv; default: %(default)s)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="restore: context lengths in tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="restore: timings of each path (default: 3)")
    parser.add_argument("--rounds", type=int, default=3, help="overhead: off/on pairs (default: 3)")
    parser.add_argument("--interleave", choices=("steps", "runs"), default="steps",
                        help="overhead: alternate the arms step by step in one loop (default), or run by run")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/checkpoint-<dtype>[-quick].json)")
    args = parse_workload_args(parser, argv, "checkpoint")
    args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    if args.interval < 1:
        parser.error("--interval must be at least 1")
    return args


# ---------------------------------------------------------------- the store
@contextmanager
def moto_server() -> Iterator[tuple[str, int]]:
    """``s3://BUCKET`` on a moto server in a child process, with the AWS variables pointing at it;
    and the server's process id."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        _wait_for_port(port, server)
        bucket = f"berth-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield f"s3://{bucket}", server.pid
    finally:
        server.terminate()
        server.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_for_port(port: int, server: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the moto server exited with status {server.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the moto server did not listen on port {port} within {timeout:.0f} s")


def fresh_store(base_url: str, name: str) -> ObjectStore:
    """A store under its own prefix of ``base_url``, so that no run finds another's blocks."""
    return open_store(f"{base_url.rstrip('/')}/{name}-{uuid.uuid4().hex[:8]}")


def empty(store: ObjectStore) -> int:
    """Delete every checkpoint object in ``store``; how many there were."""
    keys = [o.key for prefix in (SEGMENT_PREFIX, KV_PREFIX) for o in store.list(prefix)]
    for key in keys:
        store.delete(key)
    return len(keys)


class CountingStore(ObjectStore):
    """Another store, counting the objects and bytes put under each kind of key (state segments, kv
    runs, other)."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.url = inner.url
        self.objects = {"state": 0, "kv": 0, "other": 0}
        self.bytes = dict(self.objects)
        self._lock = threading.Lock()

    def put(self, key, data):
        self.inner.put(key, data)
        kind = "state" if key.startswith(SEGMENT_PREFIX) else "kv" if key.startswith(KV_PREFIX) else "other"
        with self._lock:
            self.objects[kind] += 1
            self.bytes[kind] += len(data)

    def get(self, key):
        return self.inner.get(key)

    def get_range(self, key, start, length):
        return self.inner.get_range(key, start, length)

    def open(self, key):
        return self.inner.open(key)

    def writer(self, key):
        return self.inner.writer(key)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)


# ---------------------------------------------------------------- engine helpers
def forget_cached_blocks(engine: Engine) -> None:
    """Empty the prefix cache of an idle engine, as if it were fresh: no block is found by its hash."""
    bm = engine.block_manager
    assert bm.num_used_blocks == 0, "the engine still holds blocks"
    bm.cached.clear()
    bm.block_hash = [None] * bm.num_blocks


def output_tokens(engine: Engine, request_id: str) -> int:
    return engine.requests[request_id].sequences[0].num_output_tokens


def step(engine: Engine, checkpoints: Checkpointer, restorer: Restorer) -> list:
    """One step as the engine worker takes it (its metrics aside)."""
    outputs = engine.step()
    checkpoints.after_step()
    restorer.observe_step()
    return outputs


@dataclass
class SteeredRates(TransferRates):
    """The Restorer's rates, measured as a worker measures them, with its choice overridable:
    ``force`` = "load" or "recompute" makes it take that path, None leaves the choice to the rates."""

    force: str | None = None

    def load_seconds(self, num_blocks: int, block_bytes: int) -> float:
        if self.force:
            return 0.0 if self.force == "load" else math.inf
        return super().load_seconds(num_blocks, block_bytes)

    def recompute_seconds(self, num_blocks: int, block_size: int) -> float:
        if self.force:
            return math.inf if self.force == "load" else 0.0
        return super().recompute_seconds(num_blocks, block_size)


# ---------------------------------------------------------------- 1. restore against recompute
def run_restore(loaded: LoadedModel, args, base_url: str) -> list[dict]:
    settings = Settings(model=args.model, dtype=args.dtype, threads=args.threads, kv_memory=RESTORE_KV_MEMORY,
                        max_num_batched_tokens=args.max_num_batched_tokens, checkpoint_interval=args.interval,
                        checkpoint_kv="always")
    engine = Engine(settings, loaded=loaded)
    engine.generate(WARMUP_PROMPTS, greedy_params(WARMUP_TOKENS))
    store = fresh_store(base_url, "restore")
    metrics = WorkerMetrics()
    checkpoints = Checkpointer(engine, store, settings, metrics, on_durable=Refs())
    restorer = Restorer(engine, store, checkpoints, metrics, SteeredRates())
    corpus = corpus_token_ids(loaded.tokenizer)
    rng = random.Random(args.seed)
    results = []
    try:
        for context in args.contexts:
            start = rng.randrange(len(corpus) - context)
            prompt = corpus[start:start + context - GENERATED]
            results.append(restore_context(engine, checkpoints, restorer, store, prompt, args))
            print_restore_row(results[-1])
    finally:
        restorer.close()
        checkpoints.close()
        empty(store)
    return results


def restore_context(engine: Engine, checkpoints: Checkpointer, restorer: Restorer, store: ObjectStore,
                    prompt: list[int], args) -> dict:
    context = len(prompt) + GENERATED
    rid = str(context)
    params = greedy_params(GENERATED + 8)
    checkpoint, reference, ref = checkpointed_request(engine, checkpoints, restorer, Request(rid, prompt, params))
    stored = stored_sizes(store, checkpoint, engine.fingerprint)
    timings: dict[str, list[dict]] = {"load": [], "recompute": []}
    for repeat in range(args.repeats + 1):  # the first of each is a warm-up (connections, the rates' smoothing)
        for path in ("load", "recompute") if repeat % 2 == 0 else ("recompute", "load"):
            timing = timed_resume(engine, checkpoints, restorer, Request(rid, prompt, params), path, reference, ref)
            if repeat:
                timings[path].append(timing)
    num_blocks = len(checkpoint.block_hashes())
    return {"context": context, "prompt_tokens": len(prompt), "generated_tokens": GENERATED, **stored,
            **{path: summarize_resumes(t) for path, t in timings.items()},
            "faster": min(timings, key=lambda p: statistics.median(t["seconds"] for t in timings[p])),
            "restorer": restorer_choice(restorer, num_blocks)}


def checkpointed_request(engine: Engine, checkpoints: Checkpointer, restorer: Restorer,
                         request: Request) -> tuple[RequestCheckpoint, int, str]:
    """Run ``request`` to ``GENERATED`` tokens with checkpoints on, wait for its checkpoint to be written,
    and take the next token of the undisturbed run; then drop it. (its stored checkpoint, that token,
    its ref)"""
    engine.add_request(request)
    while output_tokens(engine, request.request_id) < GENERATED:
        step(engine, checkpoints, restorer)
    assert checkpoints.save_all(120), "the checkpoint was not written within 2 minutes"  # its state at GENERATED
    engine.step()
    reference = request.sequences[0].output_token_ids[GENERATED]
    engine.abort(request.request_id)
    checkpoints.released(request.request_id)
    forget_cached_blocks(engine)
    ref = checkpoints.writer.on_durable[request.request_id]
    where = StateRef.parse(ref)
    checkpoint = RequestCheckpoint.from_json(checkpoints.writer.store.get_range(where.key, where.offset,
                                                                                where.length))
    assert checkpoint.output_tokens == GENERATED, f"the stored state has {checkpoint.output_tokens} tokens"
    return checkpoint, reference, ref


class Refs(dict):
    """Where each request's latest state is (what the jobs database keeps), as the writer reports it."""

    def __call__(self, refs: dict[str, str]) -> None:
        self.update(refs)


def stored_sizes(store: ObjectStore, checkpoint: RequestCheckpoint, fingerprint: str) -> dict:
    """Check that every block the state names is in a run on the store; their sizes."""
    hashes = checkpoint.block_hashes()
    held, nbytes = set(), 0
    for last in checkpoint.kv_runs:
        raw = store.get(kv_key(fingerprint, last))
        held.update(decode_run(raw)[0])
        nbytes += len(raw)
    missing = [h.hex() for h in hashes if h not in held]
    assert not missing, f"{len(missing)} KV blocks of the checkpoint are not on the store"
    return {"kv_blocks": len(hashes), "kv_runs": len(checkpoint.kv_runs), "kv_bytes": nbytes,
            "state_bytes": len(checkpoint.to_json())}


def timed_resume(engine: Engine, checkpoints: Checkpointer, restorer: Restorer, request: Request, path: str,
                 reference: int, ref: str) -> dict:
    """Resume ``request`` from its checkpoint by ``path``, timed from ``submit`` to its next token."""
    restorer.rates.force = path
    cached, computed = engine.stats.prompt_tokens_cached, _computed(engine.stats)
    t0 = time.perf_counter()
    restorer.submit(request, ref)
    while restorer.pending:
        for ready in restorer.ready():
            engine.add_request(ready)
        time.sleep(0.001)
    assert output_tokens(engine, request.request_id) == GENERATED, "the request did not resume from its checkpoint"
    while output_tokens(engine, request.request_id) <= GENERATED:
        engine.step()  # no ``after_step``: a slow recompute would make it due by time and move the checkpoint on
        restorer.observe_step()
    seconds = time.perf_counter() - t0
    restorer.rates.force = None
    token = request.sequences[0].output_token_ids[GENERATED]
    engine.abort(request.request_id)
    checkpoints.released(request.request_id)
    forget_cached_blocks(engine)
    return {"seconds": seconds, "same_token": token == reference,
            "tokens_cached": engine.stats.prompt_tokens_cached - cached,
            "tokens_computed": _computed(engine.stats) - computed}


def _computed(stats: EngineStats) -> int:
    return stats.prompt_tokens_computed + stats.recomputed_tokens


def summarize_resumes(timings: list[dict]) -> dict:
    seconds = [t["seconds"] for t in timings]
    return {"median_seconds": round(statistics.median(seconds), 4), "seconds": [round(s, 4) for s in seconds],
            "same_next_token": all(t["same_token"] for t in timings),
            "tokens_cached": timings[-1]["tokens_cached"], "tokens_computed": timings[-1]["tokens_computed"]}


def restorer_choice(restorer: Restorer, num_blocks: int) -> dict:
    """The Restorer's own choice for this checkpoint's blocks: at the rates it measured during the run,
    and at its start-up defaults (a worker that has measured nothing yet)."""
    measured = restorer.rates
    load, recompute = restorer.estimate(num_blocks)
    choice = {"chose": "load" if restorer.reads_blocks(num_blocks) else "recompute",
              "estimated_load_seconds": round(load, 4), "estimated_recompute_seconds": round(recompute, 4),
              "prefill_tokens_per_s": round(measured.prefill_tokens_per_second, 1),
              "storage_mb_per_s": round(measured.storage_bytes_per_second / 1e6, 1)}
    restorer.rates = TransferRates()
    choice["chose_at_defaults"] = "load" if restorer.reads_blocks(num_blocks) else "recompute"
    restorer.rates = measured
    return choice


def print_restore_row(r: dict) -> None:
    c = r["restorer"]
    print(f"[{clock()}] context {r['context']:>5}: load {r['load']['median_seconds']:.3f} s, "
          f"recompute {r['recompute']['median_seconds']:.3f} s ({r['kv_blocks']} blocks, "
          f"{r['kv_bytes'] / 1e6:.1f} MB); faster: {r['faster']}; Restorer chose: {c['chose']} "
          f"(estimates {c['estimated_load_seconds']:.3f} / {c['estimated_recompute_seconds']:.3f} s; "
          f"at defaults: {c['chose_at_defaults']}); same next token: "
          f"{r['load']['same_next_token'] and r['recompute']['same_next_token']}", flush=True)


# ---------------------------------------------------------------- 2. overhead on the workload
def run_overhead(loaded: LoadedModel, args, base_url: str, server_pid: int | None) -> dict:
    workload = make_workload(loaded.tokenizer, args.requests, args.seed)
    print(f"[{clock()}] workload: {len(workload)} requests, {workload.prompt_tokens} prompt tokens, "
          f"{workload.output_tokens} output tokens", flush=True)
    settings = berth_settings(args, workload, loaded.config).model_copy(
        update={"checkpoint_interval": args.interval, "checkpoint_kv": args.kv})
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        if args.interleave == "steps":
            pair = run_interleaved(loaded, settings, workload, fresh_store(base_url, f"overhead-{round_}"),
                                   server_pid)
            for mode in ("off", "on"):
                runs[mode].append(pair[mode])
                print(f"[{clock()}] round {round_ + 1} checkpoints {mode}: {pair[mode]['seconds']:.1f} s charged, "
                      f"{pair[mode]['tokens_per_s']:.1f} useful tok/s", flush=True)
            continue
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):  # neither always goes first
            store = fresh_store(base_url, f"overhead-{round_}") if mode == "on" else None
            run = run_workload(loaded, settings, workload, store, server_pid)
            runs[mode].append(run)
            print(f"[{clock()}] round {round_ + 1} checkpoints {mode}: {run['seconds']:.1f} s, "
                  f"{run['tokens_per_s']:.1f} useful tok/s", flush=True)
    return {"interleave": args.interleave, **summarize_overhead(runs, workload)}


def run_interleaved(loaded: LoadedModel, settings: Settings, workload: Workload, store: ObjectStore,
                    server_pid: int | None) -> dict[str, dict]:
    """Both arms at once, so that a busy machine slows them alike: two fresh engines of the same model,
    one checkpointing to ``store``, stepped in turn in one loop (which goes first alternates), each
    step timed with what the worker does after it (for the on-arm: ``after_step``, ``observe_step``,
    ``finished``). An arm's seconds are the sum of its own steps; the on-arm is also charged the CPU
    seconds of the writer's threads and of the store's server, which ran beside both arms' steps."""
    engines, metrics, done, spent = {}, {}, {}, {}
    for mode in ("off", "on"):
        engines[mode] = Engine(settings, loaded=loaded)
        engines[mode].generate(WARMUP_PROMPTS, greedy_params(WARMUP_TOKENS))
        engines[mode].stats = EngineStats()
        metrics[mode], done[mode], spent[mode] = WorkerMetrics(), {}, 0.0
    counting = CountingStore(store)
    checkpoints = Checkpointer(engines["on"], counting, settings, metrics["on"])
    restorer = Restorer(engines["on"], counting, checkpoints, metrics["on"])
    lag = {"tokens": [], "seconds": [], "tokens_per_request": []}
    cpu = CpuClock(server_pid)
    in_loop = 0.0
    load_before = os.getloadavg()[0]
    for engine in engines.values():
        for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
            engine.add_request(Request(str(i), list(prompt), greedy_params(n)))
    t_start, turn = time.perf_counter(), 0
    while any(e.has_unfinished() for e in engines.values()):
        for mode in ("off", "on") if turn % 2 == 0 else ("on", "off"):
            engine = engines[mode]
            if not engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            metrics[mode].observe_step(engine, time.perf_counter() - t0)
            c0 = time.perf_counter()
            if mode == "on":
                checkpoints.after_step()
                restorer.observe_step()
            for out in outputs:
                done[mode][out.request_id] = out.completions[0].token_ids
                if mode == "on":
                    checkpoints.finished(out.request_id)
            t1 = time.perf_counter()
            spent[mode] += t1 - t0
            if mode == "on":
                in_loop += t1 - c0
                sample_lag(metrics["on"], engine, lag)  # the benchmark's own reading: not charged
        turn += 1
    wall = time.perf_counter() - t_start
    during = (dict(counting.objects), dict(counting.bytes))
    background = cpu.since()
    charged = {"off": spent["off"], "on": spent["on"] + background["writer_threads"] + background["store_server"]}
    result = {}
    for mode in ("off", "on"):
        run = useful_timing(workload, charged[mode], [done[mode][str(i)] for i in range(len(workload))])
        run.update(step_seconds=round(spent[mode], 3), wall_seconds_both_arms=round(wall, 2),
                   load_average_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                   forward_seconds=round(engines[mode].stats.forward_seconds, 2))
        result[mode] = run
    result["on"]["cpu_seconds"] = result["off"]["cpu_seconds"] = background
    c = result["on"]["checkpoints"] = checkpoint_figures(checkpoints, restorer, counting, metrics["on"], lag)
    c["engine_loop_seconds"] = round(in_loop, 3)
    puts, nbytes = sum(during[0].values()), sum(during[1].values())
    seconds = charged["on"]
    c.update(rounds=checkpoints.rounds, steps=engines["on"].stats.steps,
             state_puts_per_round=round(c["objects"]["state"] / max(1, checkpoints.rounds), 3),
             puts_per_second=round(puts / seconds, 2), bytes_per_second=round(nbytes / seconds),
             puts_per_1000_tokens=round(1000 * sum(c["objects"].values()) / workload.output_tokens, 2))
    return result


def run_workload(loaded: LoadedModel, settings: Settings, workload: Workload, store: ObjectStore | None,
                 server_pid: int | None) -> dict:
    """The workload on a fresh engine, stepped as the engine worker steps; checkpoints to ``store`` if given
    (``server_pid``: the store's server when it runs here, for its CPU time)."""
    engine = Engine(settings, loaded=loaded)
    engine.generate(WARMUP_PROMPTS, greedy_params(WARMUP_TOKENS))
    engine.stats = EngineStats()
    metrics = WorkerMetrics()
    counting = CountingStore(store) if store is not None else None
    checkpoints = Checkpointer(engine, counting, settings, metrics) if store is not None else None
    restorer = Restorer(engine, counting, checkpoints, metrics) if store is not None else None
    lag = {"tokens": [], "seconds": [], "tokens_per_request": []}
    cpu = CpuClock(server_pid)
    in_loop = 0.0  # seconds the engine loop spends in the checkpoint calls
    load_before = os.getloadavg()[0]
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(Request(str(i), list(prompt), greedy_params(n)))
    done = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outputs = engine.step()
        metrics.observe_step(engine, time.perf_counter() - s0)
        c0 = time.perf_counter()
        if checkpoints is not None:
            checkpoints.after_step()
            restorer.observe_step()
        for out in outputs:
            done[out.request_id] = out.completions[0].token_ids
            if checkpoints is not None:
                checkpoints.finished(out.request_id)
        in_loop += time.perf_counter() - c0
        if checkpoints is not None:
            sample_lag(metrics, engine, lag)
    seconds = time.perf_counter() - t0
    during = (dict(counting.objects), dict(counting.bytes)) if counting is not None else None
    result = useful_timing(workload, seconds, [done[str(i)] for i in range(len(workload))])
    result.update(load_average_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
                  forward_seconds=round(engine.stats.forward_seconds, 2), cpu_seconds=cpu.since())
    if checkpoints is not None:
        c = result["checkpoints"] = checkpoint_figures(checkpoints, restorer, counting, metrics, lag)
        c["engine_loop_seconds"] = round(in_loop, 3)
        puts, nbytes = sum(during[0].values()), sum(during[1].values())
        c.update(rounds=checkpoints.rounds, steps=engine.stats.steps,
                 state_puts_per_round=round(c["objects"]["state"] / max(1, checkpoints.rounds), 3),
                 puts_per_second=round(puts / seconds, 2), bytes_per_second=round(nbytes / seconds),
                 puts_per_1000_tokens=round(1000 * sum(c["objects"].values()) / workload.output_tokens, 2))
    return result


def sample_lag(metrics: WorkerMetrics, engine: Engine, lag: dict) -> None:
    """The lag gauges ``after_step`` just set: tokens not yet on the store, and the age of the oldest."""
    tokens = metrics.registry.get_sample_value("berth_checkpoint_lag_tokens")
    lag["tokens"].append(tokens)
    lag["seconds"].append(metrics.registry.get_sample_value("berth_checkpoint_lag_seconds"))
    if engine.num_running:
        lag["tokens_per_request"].append(tokens / engine.num_running)


class CpuClock:
    """CPU seconds since creation: this process, the checkpoint writer's threads (by their name), the
    store's server process."""

    def __init__(self, server_pid: int | None):
        self.writer_tids = [t.native_id for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]
        self.server_pid = server_pid
        self.start = self.now()

    def now(self) -> dict:
        ticks = os.sysconf("SC_CLK_TCK")
        writer = sum(_proc_cpu(f"/proc/self/task/{tid}/stat") for tid in self.writer_tids) / ticks
        server = _proc_cpu(f"/proc/{self.server_pid}/stat") / ticks if self.server_pid else 0.0
        return {"process": time.process_time(), "writer_threads": writer, "store_server": server}

    def since(self) -> dict:
        now = self.now()
        return {k: round(now[k] - self.start[k], 2) for k in now}


def _proc_cpu(path: str) -> int:
    """utime + stime of a /proc stat file, in clock ticks (0 if it is gone)."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def checkpoint_figures(checkpoints: Checkpointer, restorer: Restorer, store: CountingStore, metrics: WorkerMetrics,
                       lag: dict) -> dict:
    """Drain the writer (timed, outside the run's time), then what it wrote and how far behind it was."""
    t0 = time.perf_counter()
    drained = checkpoints.writer.flush(300)
    drain_seconds = time.perf_counter() - t0
    restorer.close()
    checkpoints.close()

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name) or 0.0

    return {
        "drained": drained, "drain_seconds_after_run": round(drain_seconds, 3),
        "bytes": dict(store.bytes), "objects": dict(store.objects),
        "metrics_bytes": int(value("berth_checkpoint_bytes_total")),
        "states_written": int(value("berth_checkpoint_states_total")),
        "blocks_written": int(value("berth_checkpoint_blocks_total")),
        "superseded": int(value("berth_checkpoint_superseded_total")),
        "failures": int(value("berth_checkpoint_failures_total")),
        "lag_tokens": _mean_max(lag["tokens"]), "lag_tokens_per_request": _mean_max(lag["tokens_per_request"]),
        "lag_seconds": _mean_max(lag["seconds"]),
        "objects_deleted_after": empty(store.inner),
    }


def _mean_max(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 3), "max": round(max(values), 3)} if values else {}


def summarize_overhead(runs: dict[str, list[dict]], workload: Workload) -> dict:
    off = [r["tokens_per_s"] for r in runs["off"]]
    on = [r["tokens_per_s"] for r in runs["on"]]
    ratio = statistics.median(on) / statistics.median(off)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["off"], runs["on"]))
    for r in runs["off"] + runs["on"]:
        r.pop("tokens")
    return {"workload": workload.summary(), "median_tokens_per_s": {"off": statistics.median(off),
                                                                   "on": statistics.median(on)},
            "ratio_on_off": round(ratio, 4), "round_ratios": [round(b / a, 4) for a, b in zip(off, on)],
            "median_round_ratio": round(statistics.median(b / a for a, b in zip(off, on)), 4),
            "meets_target": ratio >= TARGET_RATIO, "same_tokens_on_and_off": same, "runs": runs}


def print_overhead(o: dict) -> None:
    m = o["median_tokens_per_s"]
    print(f"\ncheckpoints off: {m['off']:.1f} useful tok/s, on: {m['on']:.1f} (medians of {len(o['runs']['on'])} "
          f"rounds); on/off = {o['ratio_on_off']:.3f} (per round {o['round_ratios']}, median "
          f"{o['median_round_ratio']:.3f}; arms interleaved by {o.get('interleave', 'runs')}); "
          f"target {TARGET_RATIO}: {'met' if o['meets_target'] else 'NOT met'}; "
          f"same tokens: {o['same_tokens_on_and_off']}")
    for i, r in enumerate(o["runs"]["on"]):
        c = r["checkpoints"]
        print(f"  round {i + 1}: wrote {c['blocks_written']} KV blocks in {c['objects']['kv']} runs "
              f"({c['bytes']['kv'] / 1e6:.1f} MB) and {c['states_written']} states in {c['objects']['state']} "
              f"segments ({c['bytes']['state'] / 1e6:.2f} MB) over {c['rounds']} rounds "
              f"({c['state_puts_per_round']} state PUTs a round); {c['puts_per_second']} PUTs/s, "
              f"{c['bytes_per_second'] / 1e6:.2f} MB/s, "
              f"{c['puts_per_1000_tokens']} PUTs per 1,000 tokens; lag tokens mean/max "
              f"{c['lag_tokens'].get('mean')}/{c['lag_tokens'].get('max')} "
              f"(per request {c['lag_tokens_per_request'].get('mean')}/{c['lag_tokens_per_request'].get('max')}), "
              f"lag seconds {c['lag_seconds'].get('mean')}/{c['lag_seconds'].get('max')}; superseded "
              f"{c['superseded']}, failures {c['failures']}; drained {c['drain_seconds_after_run']} s after")
    for mode, runs in o["runs"].items():
        print(f"  checkpoints {mode}: CPU seconds per run {[r['cpu_seconds'] for r in runs]}; forward seconds "
              f"{[r['forward_seconds'] for r in runs]}"
              + (f"; engine loop in checkpoint calls {[r['checkpoints']['engine_loop_seconds'] for r in runs]} s"
                 if mode == "on" else ""))


# ---------------------------------------------------------------- main
@contextmanager
def storage(url: str) -> Iterator[tuple[str, int | None]]:
    """``url``, or a moto server's if none; and the moto server's process id."""
    if url:
        yield url, None
    else:
        with moto_server() as server:
            yield server


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, DTYPES[args.dtype])
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "dtype": args.dtype,
              "model": args.model, "interval": args.interval, "kv": args.kv, "machine": machine_info(args.threads),
              "storage": args.storage_url or "moto S3 server (child process)",
              "load_average_1m_start": round(os.getloadavg()[0], 2)}
    with storage(args.storage_url) as (base_url, server_pid):
        if args.only in (None, "restore"):
            report["restore"] = run_restore(loaded, args, base_url)
        if args.only in (None, "overhead"):
            report["overhead"] = run_overhead(loaded, args, base_url, server_pid)
            print_overhead(report["overhead"])
    report["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
