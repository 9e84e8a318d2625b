"""What the job path costs around an engine that costs nothing: requests/s against the engine alone,
and the CPU a request takes in the worker, PostgreSQL and RabbitMQ (issue 35, must-show 2).

On a GPU a request of 200 tokens is done in a few milliseconds of device time; whatever berth does
per request around the engine (a message decoded, a ledger claim, a result row, a commit, an ack)
then decides the rate. A near-free model shows that cost on a CPU: ``random_model.py --shape tiny``
(one layer, hidden size 64, the default tokenizer's vocabulary), written to a temporary folder unless
``--model`` names one. The same ``--requests`` requests (``--prompt-tokens`` random token ids each,
``--output-tokens`` out, or a number drawn uniformly from a range ``A-B``, greedy, ``ignore_eos``) run
through, each on a new engine warmed up first:

1. engine: ``jobs.hosting.generate.generate_file`` (``berth generate``): no database, no queue.
2. embedded: ``berth run``'s path (``jobs.hosting.local_run``, what ``api.run`` calls: the job accepted,
   its ingest on a thread of this process beside an engine worker in this process, which consumes the
   requests as they are published until the job ends, finalize in this process) on SQLite, the
   embedded queue and a local folder, in a fresh temporary directory.
3. servers: the same on PostgreSQL and RabbitMQ at 127.0.0.1 (``--pg-admin-url``, ``--amqp-url``),
   in a database created for the run and under a queue prefix of its own, both removed at the end.

Rate = requests (and output tokens) / wall seconds from the call (``generate_file``, ``LocalRun.submit``)
to the results written (``generate_file`` returned; the job's ``completed_at``; the phases say when
``work``, `berth run`'s wait, returned). CPU, in ms a
request: this process's (``os.times``, all threads) split into submit (the job's creation on the
calling thread and its ingest's thread, each by ``time.thread_time``: they overlap the worker now,
so the split is by thread, not by time) and worker (the rest: the loop, its committer and claim
threads, housekeeping), and the engine's step on the loop thread (``time.thread_time`` around
``Engine.step``); the ledger's process's (``worker.consumer.ledger_process``: the claims, the commits and
the finalize they call, read as the worker closes it); PostgreSQL's as
the CPU of the backends connected to the run's database plus the server's background processes
(walwriter, checkpointer, ...: shared with anyone else on the server); RabbitMQ's as the whole
``beam.smp`` process's (shared likewise). Each is read from ``/proc`` before and after the run, the
backends before their connections close. ``--rounds`` runs every system that many times, the order
rotating, and reports medians. The fleet figure: how many requests/s one broker and one database
would carry from the CPU they took here (the assumptions are printed with it).

``--set key=value`` (repeatable) overrides any field of ``worker.config.Settings`` for every system
(a simulated device, the prefetch window, ...); ``--threads`` defaults to 1 (the near-free model
gains nothing from a second thread, which would spin beside the servers). ``--device-ms`` is a crude
stand-in for a device until the simulated one is at hand: every forward also sleeps that long, the
GIL released as while a CUDA stream is waited for, so that work beside the engine's (the committer)
can hide in it; it models nothing of a step's shape.

    python benchmarks/job_path.py --quick                   # 300 requests, one round
    python benchmarks/job_path.py --rounds 2                # 3,000 requests, two rounds
    python benchmarks/job_path.py --set prefetch=512 --skip servers
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.end_to_end import (
    AMQP_URL,
    PG_ADMIN_URL,
    batch_line,
    embedded_services,
    server_services,
    servers_reachable,
)
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import clock, save_report, warmed_engine
from worker.config import Settings
from worker.engine.engine import DTYPES
from worker.model.loader import load_model

SYSTEMS = ("engine", "embedded", "servers")
TARGET_RATIO = 0.90
CORE_SHARE = 0.8  # of one core, what the fleet figure lets a broker queue or a database core use
CLK_TCK = os.sysconf("SC_CLK_TCK")
# What the fleet figure relies on beyond this machine's measurement (benchmarks/README.md cites them):
SOURCES = {
    "rabbitmq_queue": "a queue is one Erlang process, about one core at most; a node spreads its queues over its "
                      "cores (CloudAMQP, 'RabbitMQ Best Practices': 'Queues are single-threaded in RabbitMQ, and one "
                      "queue can handle up to about 50 thousand messages')",
    "rabbitmq_acks": "an ack with multiple=true settles every unacked delivery of the channel up to its tag in one "
                     "frame (rabbitmq.com, 'Consumer Acknowledgements and Publisher Confirms', 'Acknowledging "
                     "Multiple Deliveries at Once')",
    "postgres_commit": "when a commit's WAL is flushed, the other commits ready at that time are flushed with it "
                       "(postgresql.org docs, runtime-config-wal, commit_delay): concurrent workers' commits share "
                       "flushes, and backends run on separate cores",
}


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=None, help="requests (default: 3000; 300 quick)")
    parser.add_argument("--quick", action="store_true", help="300 requests, one round, unless told otherwise")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="prompt tokens a request (default: %(default)s)")
    parser.add_argument("--output-tokens", type=output_range, default=(4, 4), metavar="N or A-B",
                        help="output tokens a request, or a range drawn from uniformly (default: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of every system, rotating (default: 2; 1 quick)")
    parser.add_argument("--skip", default="", help="comma-separated systems to skip: embedded, servers")
    parser.add_argument("--model", default=None, help="a model folder (default: a tiny random one, written here)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (default: %(default)s)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a Settings field for every system (repeatable), e.g. --set prefetch=512")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="milliseconds every forward also sleeps, a stand-in device (default: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL,
                        help="a PostgreSQL database to create the run's own from (default: %(default)s)")
    parser.add_argument("--amqp-url", default=AMQP_URL, help="RabbitMQ (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/job_path[-quick].json)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (300 if args.quick else 3000)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - {"embedded", "servers"}:
        parser.error(f"--skip takes embedded and/or servers, not {sorted(args.skip - {'embedded', 'servers'})}")
    args.overrides = dict(parse_override(parser, item) for item in args.overrides)
    args.out = args.out or Path(__file__).parent / "results" / f"job_path{'-quick' if args.quick else ''}.json"
    return args


def output_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low, high = int(low), int(high or low)
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"want N or A-B with 0 < A <= B, not {text!r}")
    return low, high


def parse_override(parser: argparse.ArgumentParser, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in Settings.model_fields:
        parser.error(f"--set takes KEY=VALUE with KEY a setting (worker/config.py), not {item!r}")
    return key, value


def make_settings(args, model: str) -> Settings:
    """The systems' settings: the model, dtype and threads, then every ``--set`` (validated by ``Settings``)."""
    return Settings(**{"model": model, "dtype": args.dtype, "threads": args.threads, **args.overrides})


# ---------------------------------------------------------------- the requests
def write_requests(path: Path, args, model_name: str) -> Path:
    """``--requests`` lines of random prompts (distinct, so no prefix is shared), ``--output-tokens`` each."""
    rng = random.Random(args.seed)
    with open(path, "w") as f:
        for i in range(args.requests):
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
            f.write(json.dumps(batch_line(f"request-{i}", prompt, rng.randint(*args.output_tokens), model_name)) + "\n")
    return path


def count_output(path: Path) -> tuple[int, int]:
    """Completed lines and their output tokens in a results file."""
    lines = tokens = 0
    for line in path.read_text().splitlines():
        body = json.loads(line)["response"]["body"]
        lines += 1
        tokens += body["usage"]["completion_tokens"]
    return lines, tokens


# ---------------------------------------------------------------- CPU, read from /proc
def process_cpu() -> float:
    """Seconds of CPU this process has used, all its threads."""
    t = os.times()
    return t.user + t.system


def proc_cpu(pid: int, children: bool = False) -> float:
    """A process's utime + stime (and its reaped children's) in seconds; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / CLK_TCK


def processes(name: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose command is ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append((int(entry.name), cmdline))
    return found


class ServerCpu:
    """CPU seconds of the database's and the broker's processes (see the module's docstring)."""

    BACKGROUND = ("checkpointer", "background writer", "walwriter", "autovacuum", "logical replication",
                  "stats collector")

    def __init__(self, database: str | None):
        self.database = database

    def read(self) -> dict[str, float]:
        if self.database is None:
            return {}
        backends = background = 0.0
        for pid, cmdline in processes("postgres"):
            if f" {self.database} " in cmdline:
                backends += proc_cpu(pid)
            elif any(part in cmdline for part in self.BACKGROUND):
                background += proc_cpu(pid)
        broker = sum(proc_cpu(pid) for pid, _ in processes("beam.smp"))
        return {"postgres_backends": backends, "postgres_background": background, "rabbitmq": broker}


class StepClock:
    """The loop thread's CPU inside ``Engine.step``, wrapped on one engine."""

    def __init__(self, engine):
        self.cpu = 0.0
        self.steps = 0
        step = engine.step

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return step(*a, **k)
            finally:
                self.cpu += time.thread_time() - t0
                self.steps += 1

        engine.step = timed


class DeviceClock:
    """The simulated device's timeline from now (none on a real model): seconds to its first step, its busy
    and idle seconds between its first step and its last, and its busy share of that span."""

    def __init__(self, engine):
        self.timeline = getattr(engine.runner, "timeline", None)
        if self.timeline is not None:  # the warm-up's steps are not the run's
            self.timeline.first_at, self.timeline.busy_seconds, self.timeline.idle_seconds = None, 0.0, 0.0
        self.called = time.perf_counter()

    def figures(self) -> dict:
        t = self.timeline
        if t is None or t.first_at is None:
            return {}
        return {"first_step": round(t.first_at - self.called, 3), "busy": round(t.busy_seconds, 3),
                "idle": round(t.idle_seconds, 3), "busy_share": round(t.busy_seconds / (t.free_at - t.first_at), 3)}


class LedgerClock:
    """Each ledger call's seconds on its caller's thread (CPU and wall), by method, wrapped on one ledger."""

    METHODS = ("claim", "started", "begin", "suspect", "record", "closed_jobs", "live_tenants", "heartbeat")

    def __init__(self, ledger):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for name in self.METHODS:
            setattr(ledger, name, self._timed(name, getattr(ledger, name)))

    def _timed(self, name, method):
        def timed(*a, **k):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def figures(self, requests: int) -> dict:
        return {name: {"calls": self.calls[name], "cpu_ms_per_request": 1000 * self.cpu[name] / requests,
                       "wall_ms_per_request": 1000 * self.wall[name] / requests} for name in self.calls}


class LedgerEnd:
    """The ledger's process's CPU and the servers', read as the worker closes the ledger (its process and its
    database connections end then)."""

    def __init__(self, ledger, servers: ServerCpu, broker_url: str):
        self.figures: dict[str, float] = {}
        close = ledger.close

        def closing():
            self.figures = {**(servers.read() if broker_url else {}), "ledger_process": proc_cpu(ledger.pid)}
            close()

        ledger.close = closing


def stand_in_device(engine, milliseconds: float):
    """Every forward of ``engine`` also sleeps ``milliseconds`` (see ``--device-ms``); the engine back."""
    if milliseconds > 0:
        execute = engine.runner.execute

        def waited(*a, **k):
            out = execute(*a, **k)
            time.sleep(milliseconds / 1000)
            return out

        engine.runner.execute = waited
    return engine


# ---------------------------------------------------------------- the systems
def run_engine(loaded, settings: Settings, requests: Path, out: Path, device_ms: float = 0.0) -> dict:
    from jobs.hosting.generate import generate_file

    engine = stand_in_device(warmed_engine(loaded, settings), device_ms)
    steps = StepClock(engine)
    cpu0, t0, device = process_cpu(), time.time(), DeviceClock(engine)
    generate_file(requests, out, engine=engine, progress=False)
    seconds, cpu = time.time() - t0, process_cpu() - cpu0
    return {"seconds": seconds, "cpu": {"process": cpu, "engine_step": steps.cpu}, "steps": steps.steps,
            "device": device.figures()}


def run_whole_path(loaded, settings: Settings, requests: Path, out: Path, total: int, device_ms: float = 0.0) -> dict:
    """``berth run``'s path in this process, as ``api.run`` takes it (``jobs.hosting.local_run``): the job
    accepted and its ingest started on a thread, the worker beside it until the job ends. Phases, in
    seconds from the call: the first result committed, every line queued (the ingest's end), the last
    result."""
    from sqlalchemy import func, select

    from jobs import api
    from jobs.hosting.engine_worker import engine_worker
    from jobs.hosting.local_run import LocalRun
    from jobs.records.db import open_database
    from jobs.records.models import JobStatus, Result

    open_database(settings.database_url)  # the schema is in place before the clock starts
    worker = engine_worker(settings, stand_in_device(warmed_engine(loaded, settings), device_ms), eager_tasks=True,
                           checks_lines=True)  # as api.run: the line checks' model facts read with the worker
    steps = StepClock(worker.engine)
    ledger = LedgerClock(worker.ledger)
    database = settings.database_url.rsplit("/", 1)[1] if settings.database_url.startswith("postgresql") else None
    servers = ServerCpu(database)
    before = servers.read() if settings.broker_url else {}
    before["ledger_process"] = proc_cpu(worker.ledger.pid)
    after = LedgerEnd(worker.ledger, servers, settings.broker_url)
    cpu0, t0, created0, device = process_cpu(), time.time(), time.thread_time(), DeviceClock(worker.engine)
    here = LocalRun.submit(requests, settings)
    created = time.thread_time() - created0
    job = here.work(worker)
    returned, cpu1 = time.time(), process_cpu()
    after = after.figures
    api.results(job.id, out, settings=settings)
    if job.status is not JobStatus.COMPLETED or job.completed != total:
        raise RuntimeError(f"job {job.id} ended {job.status.value} with {job.completed} of {total} completed")
    submit = created + here.ingest.cpu_seconds
    cpu = {"process": cpu1 - cpu0, "submit": submit, "worker": cpu1 - cpu0 - submit, "engine_step": steps.cpu}
    cpu.update({k: after[k] - before.get(k, 0.0) for k in after})
    with open_database(settings.database_url).session() as s:
        first = s.scalar(select(func.min(Result.created_at)).where(Result.job_id == job.id))
    return {"seconds": job.completed_at - t0, "cpu": cpu, "steps": steps.steps, "ledger": ledger.figures(total),
            "device": device.figures(),
            "phases": {"first_result": round(first - t0, 3), "queued": round(job.in_progress_at - t0, 3),
                       "last_result": round(job.finalizing_at - t0, 3), "completed": round(job.completed_at - t0, 3),
                       "returned": round(returned - t0, 3)}}


@contextmanager
def services_for(name: str, args, workdir: Path, model_name: str):
    if name == "embedded":
        with embedded_services(workdir, name) as overrides:
            yield overrides
    else:
        with server_services(args, workdir, model_name) as overrides:
            yield overrides


def run_system(name: str, loaded, base: Settings, args, requests: Path, workdir: Path, out: Path) -> dict:
    if name == "engine":
        result = run_engine(loaded, base, requests, out, args.device_ms)
    else:
        with services_for(name, args, workdir, base.served_model_name()) as overrides:
            settings = Settings(**{**base.model_dump(), **overrides})
            result = run_whole_path(loaded, settings, requests, out, args.requests, args.device_ms)
    lines, tokens = count_output(out)
    if lines != args.requests:
        raise RuntimeError(f"{name}: {lines} results of {args.requests}")
    result.update(requests_per_s=args.requests / result["seconds"], tokens_per_s=tokens / result["seconds"],
                  output_tokens=tokens,
                  cpu_ms_per_request={k: 1000 * v / args.requests for k, v in result["cpu"].items()})
    return result


def run_round(number: int, systems: list[str], loaded, base: Settings, args, requests: Path, workdir: Path) -> dict:
    order = systems[number % len(systems):] + systems[:number % len(systems)]
    results = {}
    for name in order:
        print(f"[{clock()}] round {number + 1}: {name}", flush=True)
        load = os.getloadavg()[0]
        try:
            results[name] = run_system(name, loaded, base, args, requests, workdir, workdir / f"{name}-{number}.jsonl")
        except Exception as exc:  # noqa: BLE001 (a server going away is a result to record)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{clock()}]   FAILED: {results[name]['error']}", flush=True)
        else:
            r = results[name]
            print(f"[{clock()}]   {r['seconds']:.2f} s, {r['requests_per_s']:.1f} requests/s, CPU ms/request "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_request"].items()), flush=True)
            if "phases" in r:
                print(f"[{clock()}]   s from the call: " + ", ".join(f"{k} {v}" for k, v in r["phases"].items()),
                      flush=True)
            if r.get("device"):
                print(f"[{clock()}]   device: " + ", ".join(f"{k} {v}" for k, v in r["device"].items()), flush=True)
            if "ledger" in r:
                print(f"[{clock()}]   ledger calls, ms/request CPU/wall: " + ", ".join(
                    f"{k} ({v['calls']}) {v['cpu_ms_per_request']:.3f}/{v['wall_ms_per_request']:.3f}"
                    for k, v in r["ledger"].items()), flush=True)
        results[name]["load_average_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        gc.collect()
    return {"order": order, "systems": results}


# ---------------------------------------------------------------- the report
def summarize(rounds: list[dict], systems: list[str]) -> dict:
    """Medians over the rounds; each system's ratio to the engine alone of the same round."""
    summary = {}
    for name in systems:
        ok = [r["systems"][name] for r in rounds if "error" not in r["systems"].get(name, {"error": 1})]
        if not ok:
            continue
        ratios = [r["systems"][name]["requests_per_s"] / r["systems"]["engine"]["requests_per_s"] for r in rounds
                  if "error" not in r["systems"][name] and "error" not in r["systems"].get("engine", {"error": 1})]
        s = {"requests_per_s": statistics.median(r["requests_per_s"] for r in ok),
             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
             "cpu_ms_per_request": {k: statistics.median(r["cpu_ms_per_request"][k] for r in ok)
                                    for k in ok[0]["cpu_ms_per_request"]}}
        if ratios and name != "engine":
            s["ratio_to_engine"] = statistics.median(ratios)
            s["ratio_by_round"] = [round(x, 3) for x in ratios]
        summary[name] = s
    if "engine" in summary:
        engine_ms = summary["engine"]["cpu_ms_per_request"]["process"]
        for name in ("embedded", "servers"):
            if name in summary:
                cpu = summary[name]["cpu_ms_per_request"]
                own = cpu["process"] + cpu.get("ledger_process", 0.0)
                summary[name]["job_path_cpu_ms_per_request"] = own - engine_ms
    if "servers" in summary:
        summary["fleet"] = fleet(summary["servers"]["cpu_ms_per_request"])
    return summary


def fleet(cpu_ms: dict) -> dict:
    """Requests/s one broker queue and one database core carry at ``CORE_SHARE`` of a core, from the CPU a
    request took each here; the database's figure scales with its cores (concurrent backends), one queue's not."""
    pg = cpu_ms.get("postgres_backends", 0.0) + cpu_ms.get("postgres_background", 0.0)
    mq = cpu_ms.get("rabbitmq", 0.0)
    return {"core_share": CORE_SHARE,
            "postgres_requests_per_s_per_core": CORE_SHARE * 1000 / pg if pg else None,
            "rabbitmq_requests_per_s_per_queue": CORE_SHARE * 1000 / mq if mq else None,
            "sources": SOURCES}


def print_report(report: dict) -> None:
    print(f"\njob path: {report['requests']} requests of {report['prompt_tokens']} prompt and "
          f"{'-'.join(map(str, sorted(set(report['output_tokens']))))} output tokens, {report['rounds']} round(s); "
          f"{machine_line(report['machine'])}; settings {report['overrides'] or 'defaults'}"
          + (f"; a stand-in device of {report['device_ms']} ms a forward" if report["device_ms"] else ""))
    for name, s in report["summary"].items():
        if name == "fleet":
            continue
        ratio = s.get("ratio_to_engine")
        print(f"  {name:<9} {s['requests_per_s']:8.1f} requests/s {s['tokens_per_s']:9.1f} output tok/s"
              + (f"   {ratio:.3f} of the engine alone (target {TARGET_RATIO}: "
                 f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}), by round {s['ratio_by_round']}"
                 if ratio is not None else ""))
        print("            CPU ms/request: " + ", ".join(f"{k} {v:.3f}" for k, v in s["cpu_ms_per_request"].items())
              + (f"; the job path beyond the engine alone {s['job_path_cpu_ms_per_request']:.3f}"
                 if "job_path_cpu_ms_per_request" in s else ""))
    f = report["summary"].get("fleet")
    if f:
        def rate(x):
            return f"{x:,.0f}" if x else "n/a"
        print(f"  fleet, at {f['core_share']:.0%} of a core: PostgreSQL {rate(f['postgres_requests_per_s_per_core'])} "
              f"requests/s per core (its backends run on many cores), RabbitMQ "
              f"{rate(f['rabbitmq_requests_per_s_per_queue'])} requests/s per queue (a queue is one core; a node "
              "spreads queues over its cores). The fleet of 100 GPU workers at 250 requests/s needs 25,000.")
        for source in f["sources"].values():
            print(f"    - {source}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="berth-job-path-"))
    try:
        model = args.model
        if model is None:
            from benchmarks.random_model import TINY, write

            model = str(workdir / "tiny-model")
            write(Path(model), TINY, DTYPES[args.dtype], args.seed, shards=1)
        base = make_settings(args, model)
        loaded = load_model(model, DTYPES[args.dtype])
        systems = [s for s in SYSTEMS if s not in args.skip]
        if "servers" in systems and not servers_reachable(args):
            systems.remove("servers")
            print(f"[{clock()}] servers: PostgreSQL or RabbitMQ unreachable, skipped", flush=True)
        requests = write_requests(workdir / "requests.jsonl", args, base.served_model_name())
        rounds = [run_round(i, systems, loaded, base, args, requests, workdir) for i in range(args.rounds)]
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "rounds": args.rounds,
              "dtype": args.dtype, "model": args.model or "tiny (random_model.py --shape tiny)",
              "overrides": args.overrides, "device_ms": args.device_ms, "machine": machine_info(args.threads),
              "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
              "summary": summarize(rounds, systems), "by_round": rounds}
    print_report(report)
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
