"""berth's whole path (submit -> results) against its engine alone, on the throughput benchmark's workload.

The jobs issue asks that berth's end-to-end throughput be at least 90% of the engine alone on the
same run, that a 100,000-line job be accepted in seconds, not minutes, and that status queries stay
fast while a job runs. This measures all three in one run.

The workload (``benchmarks/workload.py``, seed 0) is written as an OpenAI Batch file: one
``/v1/completions`` line per request, the prompt as token ids, ``max_tokens`` its output length,
greedy, ``ignore_eos``. Every system runs that same file on a new engine built from the one loaded
model (so nothing carries over in a prefix cache), warmed up before its clock starts:

1. engine: ``jobs.hosting.generate.generate_file`` (``berth generate``): no database, no queue.
2. embedded: ``berth run``'s path on the defaults: a SQLite database, the embedded SQLite queue and
   a local folder in a fresh directory; ``api.submit`` (ingest in this process), an engine worker in
   this process, finalize in this process.
3. servers: the same through PostgreSQL and RabbitMQ on 127.0.0.1 when both answer, in a database
   and under a queue prefix of its own, dropped and deleted at the end. Ingest and finalize run
   eagerly in this process too, so that only the database and the broker differ from 2.

Throughput = useful output tokens / wall seconds from the start (``generate_file`` called,
``api.submit`` called) to the results file written (``generate_file`` returned; the job's
``completed_at``, stamped once finalize has written its output file). ``--rounds N`` runs every
system N times, the order rotating each round, and reports medians.

While 2 and 3 run, a separate process calls ``api.status`` and ``api.list_jobs`` every
``--status-interval`` seconds (a user's ``berth status``); their latencies are reported. Last, a
``--submit-lines`` file (the workload's lines repeated, 100,000 by default) is submitted on each
backend: ``api.submit`` with ingest, until every line is validated, stored and published.

    python benchmarks/end_to_end.py --quick              # 32 requests
    python benchmarks/end_to_end.py --rounds 3           # 256 requests, three rounds
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import (
    add_workload_options,
    berth_settings,
    clock,
    parse_workload_args,
    save_report,
    warmed_engine,
)
from benchmarks.workload import Workload, make_workload
from worker.config import Settings
from worker.engine.engine import DTYPES, Engine
from worker.model.base import LoadedModel
from worker.model.loader import load_model

SYSTEMS = ("engine", "embedded", "servers")
TARGET_RATIO = 0.90
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
TENANT = "default"
PROBE_START_TIMEOUT = 120.0  # seconds for the status probe process to import berth and open the database


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(parser)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every system, alternating (default: 1)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: servers, submit")
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="the worker's checkpoint interval in tokens (default: berth's default; 0 = off)")
    parser.add_argument("--status-interval", type=float, default=0.1,
                        help="seconds between a status probe's rounds of queries (default: %(default)s)")
    parser.add_argument("--submit-lines", type=int, default=100_000,
                        help="lines of the submission test (default: %(default)s)")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL, help="a PostgreSQL database to create the "
                        "benchmark's own from (default: %(default)s)")
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/end_to_end-<dtype>[-quick].json)")
    args = parse_workload_args(parser, argv, "end_to_end")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - {"servers", "submit"}:
        parser.error(f"--skip takes servers and/or submit, not {sorted(args.skip - {'servers', 'submit'})}")
    return args


# ---------------------------------------------------------------- the request files
def batch_line(custom_id: str, prompt: list[int], max_tokens: int, model: str) -> dict:
    """One OpenAI Batch request: the prompt as token ids, greedy, exactly ``max_tokens`` tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def write_batch_file(path: Path, workload: Workload, model: str, lines: int | None = None) -> Path:
    """The workload as a request file; with ``lines``, its requests repeated up to that many lines."""
    with open(path, "w") as f:
        for i in range(len(workload) if lines is None else lines):
            k = i % len(workload)
            f.write(json.dumps(batch_line(f"request-{i}", workload.prompts[k], workload.output_lens[k], model)) + "\n")
    return path


def read_output(path: Path, workload: Workload) -> dict:
    """Useful output tokens in a results file (per request, at most what it asked for) and each
    request's texts, by custom_id."""
    useful, texts = 0, {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        body = item["response"]["body"]
        asked = workload.output_lens[int(item["custom_id"].removeprefix("request-"))]
        useful += min(body["usage"]["completion_tokens"], asked)
        texts[item["custom_id"]] = [c["text"] for c in body["choices"]]
    return {"useful_tokens": useful, "texts": texts}


# ---------------------------------------------------------------- the systems
def run_engine(loaded: LoadedModel, settings: Settings, request_file: Path, workload: Workload, out: Path) -> dict:
    """``generate_file`` on the request file, timed from the call to the output file written."""
    from jobs.hosting.generate import generate_file

    engine = warmed_engine(loaded, settings)
    t0 = time.time()
    summary = generate_file(request_file, out, engine=engine, progress=False)
    seconds = time.time() - t0
    return {**timing(out, workload, seconds), "generation_seconds": round(summary.seconds, 3),
            "engine": engine_figures(engine)}


def run_whole_path(loaded: LoadedModel, settings: Settings, request_file: Path, workload: Workload, out: Path,
                   status_interval: float) -> dict:
    """Submit, an engine worker in this process until the job ends, the results fetched; timed from
    ``api.submit`` called to the job's results file written (its ``completed_at``). A status probe
    queries the job from another process meanwhile."""
    from jobs import api
    from jobs.hosting.engine_worker import engine_worker
    from jobs.records.db import open_database
    from jobs.records.models import JobStatus

    open_database(settings.database_url)  # the schema is in place before the clock starts
    worker = engine_worker(settings, warmed_engine(loaded, settings), eager_tasks=True)
    with StatusProbe(settings, status_interval) as probe:
        t0 = time.time()
        job = api.submit(request_file, settings, eager=True)
        probe.watch(job.id)
        worker.run(until=lambda: api.status(job.id, settings).status.is_final)
        api.results(job.id, out, settings=settings)
        copied = time.time()
    job = api.status(job.id, settings)
    if job.status is not JobStatus.COMPLETED or job.completed != len(workload):
        raise RuntimeError(f"job {job.id} ended {job.status.value} with {job.completed} of {len(workload)} completed")
    result = timing(out, workload, job.completed_at - t0)
    result["phases"] = {"queued": round(job.in_progress_at - t0, 3), "last_result": round(job.finalizing_at - t0, 3),
                        "results_written": round(job.completed_at - t0, 3), "results_copied": round(copied - t0, 3)}
    result["engine"] = engine_figures(worker.engine)
    result["status_queries"] = probe.latencies
    return result


def timing(out: Path, workload: Workload, seconds: float) -> dict:
    output = read_output(out, workload)
    return {"seconds": round(seconds, 3), "useful_tokens": output["useful_tokens"],
            "tokens_per_s": round(output["useful_tokens"] / seconds, 2), "texts": output["texts"]}


def engine_figures(engine: Engine) -> dict:
    s = engine.stats
    return {"steps": s.steps, "forward_seconds": round(s.forward_seconds, 3), "preemptions": s.preemptions,
            "output_tokens": s.output_tokens}


# ---------------------------------------------------------------- status queries under load
class StatusProbe:
    """A process that, once told a job's id, calls ``api.status`` on it and ``api.list_jobs`` every
    ``interval`` seconds until stopped, timing each call. It starts (imports berth, opens the
    database) before the benchmark's clock does."""

    def __init__(self, settings: Settings, interval: float):
        context = multiprocessing.get_context("spawn")
        self.jobs, self.results, self.stop_event = context.Queue(), context.Queue(), context.Event()
        self.process = context.Process(target=probe_status, daemon=True,
                                       args=(settings.model_dump(), interval, self.jobs, self.results, self.stop_event))
        self.latencies: dict = {}

    def __enter__(self) -> StatusProbe:
        self.process.start()
        ready = self.results.get(timeout=PROBE_START_TIMEOUT)
        if ready != "ready":
            raise RuntimeError(f"the status probe failed to start: {ready}")
        return self

    def watch(self, job_id: str) -> None:
        self.jobs.put(job_id)

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.jobs.put(None)  # in case it still waits for a job
        try:
            self.latencies = summarize_latencies(self.results.get(timeout=60))
        finally:
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()


def probe_status(settings: dict, interval: float, jobs, results, stop) -> None:
    """The probe process: see ``StatusProbe``. Sends "ready", then the latencies in seconds by call."""
    try:
        from jobs import api

        settings = Settings(**settings)
        api.list_jobs(settings)
        results.put("ready")
    except Exception as exc:  # noqa: BLE001 (reported by the parent)
        results.put(f"{type(exc).__name__}: {exc}")
        return
    job_id = jobs.get()
    calls: dict[str, Callable] = {"status": lambda: api.status(job_id, settings),
                                  "list_jobs": lambda: api.list_jobs(settings)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    errors = 0
    while job_id is not None and not stop.is_set():
        for name, call in calls.items():
            t0 = time.perf_counter()
            try:
                call()
            except Exception:  # noqa: BLE001 (a server restarting: counted, not fatal)
                errors += 1
                continue
            seconds[name].append(time.perf_counter() - t0)
        stop.wait(interval)
    results.put({**seconds, "errors": errors})


def summarize_latencies(seconds: dict) -> dict:
    """Count, p50, p95 and max in milliseconds, by call."""
    summary = {"errors": seconds.pop("errors", 0)}
    for name, values in seconds.items():
        if values:
            ms = sorted(v * 1000 for v in values)
            summary[name] = {"count": len(ms), "p50_ms": round(percentile(ms, 50), 2),
                             "p95_ms": round(percentile(ms, 95), 2), "max_ms": round(ms[-1], 2), "ms": ms}
    return summary


def percentile(sorted_values: list[float], p: float) -> float:
    """The ``p``-th percentile of sorted values, linearly interpolated."""
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# ---------------------------------------------------------------- where the services are
@contextmanager
def embedded_services(workdir: Path, name: str) -> Iterator[dict]:
    """``berth run``'s defaults in a fresh folder: SQLite database, embedded queue beside it, file store."""
    folder = workdir / f"{name}-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        yield {"database_url": f"sqlite:///{folder}/berth.db", "broker_url": "", "storage_url": f"file://{folder}/store"}
    finally:
        from jobs.records.db import close_database

        close_database(f"sqlite:///{folder}/berth.db")
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def server_services(args, workdir: Path, model: str) -> Iterator[dict]:
    """A fresh PostgreSQL database and RabbitMQ queue prefix, dropped and deleted on leaving."""
    from sqlalchemy import create_engine, make_url, text

    from jobs.records.db import close_database

    name = f"berth_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(args.pg_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.pg_admin_url).set(database=name).render_as_string(hide_password=False)
    prefix = f"berth-bench-{uuid.uuid4().hex[:10]}"
    try:
        with embedded_services(workdir, "store") as local:
            yield {"database_url": url, "broker_url": args.amqp_url, "queue_prefix": prefix,
                   "storage_url": local["storage_url"]}
    finally:
        close_database(url)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        delete_queues(args.amqp_url, prefix, model)


def delete_queues(amqp_url: str, prefix: str, model: str) -> None:
    """Delete the queues and exchanges berth declared under ``prefix``."""
    from kombu import Connection

    from worker.messaging.topology import Topology

    topology = Topology(prefix)
    try:
        with Connection(amqp_url) as conn:
            channel = conn.channel()
            for queue in (topology.request_queue(model, TENANT).name, topology.dead_queue.name, topology.celery_queue):
                channel.queue_delete(queue)
            for exchange in (topology.exchange.name, topology.dead_exchange.name, topology.celery_queue):
                channel.exchange_delete(exchange)
    except Exception as exc:  # noqa: BLE001 (left-overs are harmless; say so and go on)
        print(f"[{clock()}] could not delete the queues under {prefix}: {exc}", flush=True)


def servers_reachable(args) -> bool:
    return all(_answers(url, port) for url, port in ((args.pg_admin_url, 5432), (args.amqp_url, 5672)))


def _answers(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2).close()
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- submission of a large file
def time_submission(settings: Settings, request_file: Path, lines: int) -> dict:
    """``api.submit`` with ingest in this process: every line validated, stored and published
    (``seconds``); ``accepted_seconds``: until the job's row existed (its input file copied), which
    is when ``berth submit`` returns where a Celery worker does the ingest."""
    from sqlalchemy import func, select

    from jobs import api
    from jobs.lines.validate import model_info
    from jobs.records.db import open_database
    from jobs.records.models import RequestRow

    db = open_database(settings.database_url)
    model_info(settings)  # the tokenizer, loaded once per process (timed apart: validator_load_seconds)
    t0, wall0 = time.perf_counter(), time.time()
    job = api.submit(request_file, settings, eager=True)
    seconds = time.perf_counter() - t0
    with db.session() as s:
        published = s.scalar(select(func.count()).where(RequestRow.job_id == job.id,
                                                        RequestRow.published_at.is_not(None)))
    if job.total != lines or published != lines:
        raise RuntimeError(f"job {job.id}: {job.total} lines stored, {published} published, of {lines}")
    return {"lines": lines, "seconds": round(seconds, 2), "lines_per_s": round(lines / seconds, 1),
            "accepted_seconds": round(job.created_at - wall0, 2), "status": job.status.value}


def validator_load_seconds(settings: Settings) -> float:
    """What the first submission in a process pays to load the tokenizer and config for validation."""
    from jobs.lines.validate import model_info

    t0 = time.perf_counter()
    model_info(settings)
    return round(time.perf_counter() - t0, 2)


# ---------------------------------------------------------------- one run of everything
def measure(name: str, fn: Callable[[], dict]) -> dict:
    """Run one system, noting the load average around it; a failure is recorded, not raised."""
    print(f"[{clock()}] {name}: running", flush=True)
    load_before = os.getloadavg()[0]
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 (a server going away is a result to record)
        result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{clock()}] {name}: FAILED: {result['error']}", flush=True)
    else:
        print(f"[{clock()}] {name}: {result['seconds']:.1f} s, {result['tokens_per_s']:.1f} useful tok/s"
              + (f" (phases {result['phases']})" if "phases" in result else ""), flush=True)
    result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    gc.collect()  # the run's engine and its KV cache go before the next one is built
    return result


def run_round(number: int, systems: list[str], loaded: LoadedModel, base: Settings, args, request_file: Path,
              workload: Workload, workdir: Path) -> dict:
    """Every system once, in an order that rotates with the round's number."""
    order = systems[number % len(systems):] + systems[:number % len(systems)]
    results = {name: measure(name, partial(run_system, name, loaded, base, args, request_file, workload, workdir,
                                           workdir / f"{name}-round{number}.jsonl"))
               for name in order}
    agreement(results)
    return {"order": order, "systems": results}


def run_system(name: str, loaded: LoadedModel, base: Settings, args, request_file: Path, workload: Workload,
               workdir: Path, out: Path) -> dict:
    if name == "engine":
        return run_engine(loaded, base, request_file, workload, out)
    with services_for(name, args, workdir, base) as overrides:
        return run_whole_path(loaded, base.model_copy(update=overrides), request_file, workload, out,
                              args.status_interval)


def services_for(name: str, args, workdir: Path, base: Settings):
    """The context that makes (and on leaving removes) the database and queue of system ``name``."""
    if name == "embedded":
        return embedded_services(workdir, name)
    return server_services(args, workdir, base.served_model_name())


def agreement(results: dict) -> None:
    """Per system, the requests whose output texts equal the engine-alone run's."""
    reference = results.get("engine", {}).get("texts")
    for r in results.values():
        texts = r.pop("texts", None)
        if reference is not None and texts is not None:
            r["same_output_as_engine"] = sum(texts.get(k) == v for k, v in reference.items())


def submissions(args, base: Settings, workload: Workload, workdir: Path, systems: list[str]) -> dict:
    """Time the submission of an ``args.submit_lines``-line file on each backend."""
    path = write_batch_file(workdir / "submit.jsonl", workload, base.served_model_name(), args.submit_lines)
    results = {"file_mb": round(path.stat().st_size / 1e6, 1)}
    for name in systems:
        if name == "engine":
            continue
        print(f"[{clock()}] submit {args.submit_lines} lines, {name}: running", flush=True)
        try:
            with services_for(name, args, workdir, base) as overrides:
                results[name] = time_submission(base.model_copy(update=overrides), path, args.submit_lines)
            print(f"[{clock()}] submit, {name}: {results[name]['seconds']:.1f} s "
                  f"({results[name]['lines_per_s']:.0f} lines/s)", flush=True)
        except Exception as exc:  # noqa: BLE001 (a server going away is a result to record)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{clock()}] submit, {name}: FAILED: {results[name]['error']}", flush=True)
    path.unlink()
    return results


# ---------------------------------------------------------------- summary and report
def summarize(rounds: list[dict]) -> dict:
    """Per system: median seconds and tokens/s over the rounds, the ratio to the engine alone (the
    median of each round's ratio, and the ratio of the medians), the status latencies pooled."""
    summary = {}
    for name in SYSTEMS:
        runs = [r["systems"][name] for r in rounds if "tokens_per_s" in r["systems"].get(name, {})]
        if not runs:
            continue
        s = {"runs": len(runs), "median_seconds": round(statistics.median(r["seconds"] for r in runs), 2),
             "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
             "useful_tokens": runs[0]["useful_tokens"]}
        paired = [r["systems"][name]["tokens_per_s"] / r["systems"]["engine"]["tokens_per_s"] for r in rounds
                  if "tokens_per_s" in r["systems"].get(name, {}) and "tokens_per_s" in r["systems"]["engine"]]
        if name != "engine" and paired:
            s["ratio_to_engine"] = round(statistics.median(paired), 3)
            s["ratio_by_round"] = [round(p, 3) for p in paired]
            s["meets_target"] = s["ratio_to_engine"] >= TARGET_RATIO
            s["same_output_as_engine"] = min(r.get("same_output_as_engine", 0) for r in runs)
            s["status_queries"] = pooled_latencies([r["status_queries"] for r in runs])
        summary[name] = s
    engine = summary.get("engine")
    for name, s in summary.items():
        if name != "engine" and engine:
            s["ratio_of_medians"] = round(s["median_tokens_per_s"] / engine["median_tokens_per_s"], 3)
    return summary


def pooled_latencies(probes: list[dict]) -> dict:
    pooled = {"errors": sum(p.get("errors", 0) for p in probes)}
    for call in ("status", "list_jobs"):
        ms = sorted(v for p in probes for v in p.get(call, {}).get("ms", []))
        if ms:
            pooled[call] = {"count": len(ms), "p50_ms": round(percentile(ms, 50), 2),
                            "p95_ms": round(percentile(ms, 95), 2), "max_ms": round(ms[-1], 2)}
    return pooled


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\n{w['requests']} requests, {w['prompt_tokens']} prompt tokens, {w['output_tokens']} useful output "
          f"tokens; {report['dtype']}, {machine_line(report['machine'])}, {report['rounds']} round(s)")
    print(f"{'system':<10}{'runs':>6}{'median s':>10}{'tok/s':>9}{'/ engine':>10}{'same text':>11}")
    for name, s in report["summary"].items():
        ratio = f"{s['ratio_to_engine']:.3f}" if "ratio_to_engine" in s else ""
        same = f"{s['same_output_as_engine']}/{w['requests']}" if "same_output_as_engine" in s else ""
        print(f"{name:<10}{s['runs']:>6}{s['median_seconds']:>10.1f}{s['median_tokens_per_s']:>9.1f}{ratio:>10}{same:>11}")
    for name, s in report["summary"].items():
        if "ratio_to_engine" in s:
            print(f"{name}: {s['ratio_to_engine']:.3f} of the engine alone (target {TARGET_RATIO}: "
                  f"{'met' if s['meets_target'] else 'NOT met'}); by round {s['ratio_by_round']}")
            q = s["status_queries"]
            for call in ("status", "list_jobs"):
                if call in q:
                    print(f"  {call:<10} under load: {q[call]['count']} calls, p50 {q[call]['p50_ms']:.1f} ms, "
                          f"p95 {q[call]['p95_ms']:.1f} ms, max {q[call]['max_ms']:.1f} ms")
            if q["errors"]:
                print(f"  {q['errors']} status calls failed")
    sub = report.get("submission")
    if sub:
        print(f"\nsubmission of {report['submit_lines']} lines ({sub['file_mb']} MB; the validator's tokenizer, loaded "
              f"once per process, took {report['validator_load_seconds']} s more):")
        for name, r in sub.items():
            if isinstance(r, dict):
                print(f"  {name:<10}" + (f"error: {r['error']}" if "error" in r else
                                         f"{r['seconds']:.1f} s, {r['lines_per_s']:.0f} lines/s "
                                         f"(accepted after {r['accepted_seconds']:.2f} s)"))


def drop_samples(rounds: list[dict]) -> None:
    """The raw latency samples stay out of the JSON (their summaries are in it)."""
    for r in rounds:
        for result in r["systems"].values():
            for call in ("status", "list_jobs"):
                result.get("status_queries", {}).get(call, {}).pop("ms", None)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    loaded = load_model(args.model, DTYPES[args.dtype])
    workload = make_workload(loaded.tokenizer, args.requests, args.seed)
    print(f"[{clock()}] workload: {workload.summary()}", flush=True)
    base = berth_settings(args, workload, loaded.config)
    if args.checkpoint_interval is not None:
        base = base.model_copy(update={"checkpoint_interval": args.checkpoint_interval})
    systems = list(SYSTEMS)
    if "servers" in args.skip or not servers_reachable(args):
        systems.remove("servers")
        print(f"[{clock()}] servers: {'skipped' if 'servers' in args.skip else 'PostgreSQL or RabbitMQ unreachable'}",
              flush=True)
    validator_load = validator_load_seconds(base)
    workdir = Path(tempfile.mkdtemp(prefix="berth-e2e-"))
    try:
        request_file = write_batch_file(workdir / "requests.jsonl", workload, base.served_model_name())
        rounds = [run_round(i, systems, loaded, base, args, request_file, workload, workdir)
                  for i in range(args.rounds)]
        submission = None if "submit" in args.skip else submissions(args, base, workload, workdir, systems)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "dtype": args.dtype, "quick": args.quick,
        "model": args.model, "rounds": args.rounds, "systems": systems,
        "settings": {"kv_memory": args.kv_memory, "block_size": base.block_size,
                     "max_num_batched_tokens": base.max_num_batched_tokens, "max_num_seqs": base.max_num_seqs,
                     "checkpoint_interval": base.checkpoint_interval, "status_interval": args.status_interval},
        "machine": machine_info(args.threads), "workload": workload.summary(),
        "summary": summarize(rounds), "by_round": rounds,
        "validator_load_seconds": validator_load, "submit_lines": args.submit_lines, "submission": submission,
    }
    drop_samples(rounds)
    print_report(report)
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
