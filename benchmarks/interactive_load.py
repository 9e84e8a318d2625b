"""Interactive latency under batch load (issue 24): berth serve, and llama-server side by side, in one run.

berth: ``berth serve`` on the embedded defaults (SQLite, the embedded queue and a file store in a
temporary folder, the engine worker in the server's process, Prometheus metrics on a free port), the
default model in ``--dtype`` with ``--threads``, started as its own process. Three phases of
``--duration`` seconds each:

1. **batch alone**: a Batch API job (tenant ``batch``: the file uploaded through ``POST /v1/files``,
   ``POST /v1/batches``), the throughput benchmark's requests (``benchmarks/workload.py``: prompts of
   16-512 tokens as token ids, 8-256 output tokens each, greedy, EOS ignored) repeated to more lines
   than the phase can finish, so the worker stays saturated. Once its rate is steady (two successive
   5 s windows within 15%: past the first wave of prompts) and ``--settle`` seconds more, its
   tokens/s is read over the phase from the worker's own counter
   (``berth_tenant_output_tokens_total{tenant="batch"}``); the job is then cancelled and the engine
   left to empty. This rate is the worker's capacity.
2. **interactive alone**: a seeded Poisson stream of streaming chat requests (tenant ``live``,
   ``POST /v1/chat/completions``, ``stream: true``): the user message is the decoded text of another
   seeded draw of the workload's prompts, ``--interactive-tokens`` output tokens, greedy, EOS
   ignored. The rate is ``--rate`` requests/s, or by default the rate whose output tokens are
   ``--load-share`` (10%) of the capacity measured in phase 1.
3. **both**: a new batch job as in 1, settled, then the same interactive stream (the same arrival
   times and messages) while the batch job runs; its tokens/s over the phase as in 1.

llama-server (``benchmarks/llama_cpp_build.py``'s build; the default model requantised to F32 by
``llama-quantize``, its KV cache in the run's dtype, ``-t`` = the same threads): the same three
phases, the batch load being ``--llama-batch-clients`` client threads that each send the same batch
requests one after another to ``POST /completion`` (token-id prompts, ``ignore_eos``,
``cache_prompt false``), streamed only so that the tokens generated within the phase can be counted.
The server gets that many slots plus ``--llama-spare-slots`` so an interactive request never waits
for a slot; it has no priority between the two kinds of request.

Measured per interactive request: TTFT (request sent to the first chunk with content), the gaps
between content chunks (ITL; berth may hold a few tokens back and send them as one chunk, so a
chunk is not always one token), and TPOT ((last content chunk - first) / (tokens - 1), a per-token
figure for either system). Reported: p50 and p99 of each per phase, the batch tokens/s of phases 1
and 3, and issue 24's goals for berth: TTFT p99 under batch load at most 2x the idle p99, ITL p99
at most 1.5x, batch tokens/s with the interactive load at least 0.8 of batch alone.

    python benchmarks/interactive_load.py --quick              # 30 s phases
    python benchmarks/interactive_load.py                      # 180 s phases
    python benchmarks/interactive_load.py --rate 2 --skip llama

Writes JSON to ``--out`` (default ``benchmarks/results/interactive-load-<dtype>[-quick].json``), the
servers' logs beside it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks import llama_cpp_build
from benchmarks.end_to_end import batch_line, percentile
from benchmarks.llama_server import LlamaServer, _free_port, _round_up, stop_process
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import clock, save_report
from benchmarks.workload import OUTPUT_LEN_RANGE, PROMPT_LEN_RANGE, Workload, make_workload
from worker.config import Settings, default_model_path

REPO = Path(__file__).resolve().parents[1]
GOALS = {"ttft_p99": 2.0, "itl_p99": 1.5, "batch": 0.8}
"""Issue 24: under batch load / alone at most (latencies), with / without interactive load at least (batch)."""
BATCH_WORKLOAD = 256
"""Distinct batch requests (the throughput benchmark's full workload), repeated to fill a job."""
START_TIMEOUT = 600.0
FINAL = ("completed", "failed", "cancelled", "expired")
FEW_REQUESTS = 20


# ---------------------------------------------------------------- one streamed request
@dataclass
class Streamed:
    """One interactive request: when it was sent (seconds from the phase start), when each content
    chunk came, how many tokens it generated (the usage, else the asked length), or its error."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunks) < 2 or not self.tokens or self.tokens < 2:
            return None
        return (self.chunks[-1] - self.chunks[0]) / (self.tokens - 1)


def sse_events(url: str, body: dict, key: str | None, timeout: float = 600.0, stop: threading.Event | None = None):
    """POST ``body`` and yield each server-sent event's JSON object (``data: [DONE]`` ends it).
    An HTTP error raises ``RuntimeError`` with the status and body; ``stop`` closes the stream early."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", parts.path, json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        while not (stop and stop.is_set()):
            line = response.readline()
            if not line:
                return
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
    finally:
        conn.close()


def stream_chat(url: str, body: dict, key: str | None, phase_start: float) -> Streamed:
    """One streamed chat request, its chunks timed against ``phase_start`` (``time.perf_counter``)."""
    result = Streamed(sent=time.perf_counter() - phase_start)
    try:
        for event in sse_events(url, body, key):
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                result.chunks.append(time.perf_counter() - phase_start)
            if event.get("usage"):
                result.tokens = event["usage"].get("completion_tokens")
    except Exception as exc:  # noqa: BLE001 (a failed request is a result)
        result.error = f"{type(exc).__name__}: {exc}"
    if result.tokens is None and result.error is None:
        result.tokens = body["max_tokens"]
    return result


# ---------------------------------------------------------------- the interactive stream
@dataclass(frozen=True)
class InteractiveStream:
    """Arrival times (seconds from the phase start, Poisson) and the chat bodies sent then."""

    arrivals: list[float]
    bodies: list[dict]
    rate: float
    duration: float


def make_stream(tokenizer, rate: float, duration: float, max_tokens: int, seed: int, model: str) -> InteractiveStream:
    """A Poisson stream of ``rate`` requests/s over ``duration`` seconds, drawn from ``seed``: each a
    streaming chat request whose user message is the text of a workload prompt (drawn from ``seed + 1``)."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    prompts = make_workload(tokenizer, max(1, len(arrivals)), seed + 1).prompts
    bodies = [{"model": model, "messages": [{"role": "user", "content": tokenizer.decode(p)}],
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for p in prompts[:len(arrivals)]]
    return InteractiveStream(arrivals, bodies, rate, duration)


def run_stream(url: str, stream: InteractiveStream, key: str | None, on_start=None, on_end=None) -> list[Streamed]:
    """Send each request at its arrival time (a thread each), wait for all; ``on_start()`` right at the
    phase start and ``on_end()`` at its nominal end (``stream.duration``), before the stragglers finish."""
    with ThreadPoolExecutor(max_workers=min(512, max(1, len(stream.arrivals)))) as pool:
        start = time.perf_counter()
        if on_start:
            on_start()
        futures = []
        for at, body in zip(stream.arrivals, stream.bodies):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            futures.append(pool.submit(stream_chat, url, body, key, start))
        time.sleep(max(0.0, start + stream.duration - time.perf_counter()))
        if on_end:
            on_end()
        results = [f.result() for f in futures]
    return results


def latency_figures(results: list[Streamed], max_tokens: int) -> dict:
    """p50/p99 (ms) of TTFT, chunk gaps and TPOT, counts, and chunks per token."""
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = sorted(r.ttft * 1000 for r in ok)
    gaps = sorted(1000 * (b - a) for r in ok for a, b in zip(r.chunks, r.chunks[1:]))
    tpot = sorted(r.tpot * 1000 for r in ok if r.tpot is not None)
    figures = {"requests": len(results), "errors": len(results) - len(ok),
               "error_examples": sorted({r.error for r in results if r.error})[:3],
               "wrong_lengths": sum(r.tokens != max_tokens for r in ok),
               "chunks_per_token": round(sum(len(r.chunks) for r in ok) / max(1, sum(r.tokens or 0 for r in ok)), 3)}
    for name, values in (("ttft", ttft), ("itl", gaps), ("tpot", tpot)):
        if values:
            figures[name] = {"p50_ms": round(percentile(values, 50), 2), "p99_ms": round(percentile(values, 99), 2),
                             "max_ms": round(values[-1], 2), "count": len(values)}
    return figures


# ---------------------------------------------------------------- berth serve
def scrape(metrics_url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value}."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class BerthServe:
    """``berth serve`` on the embedded defaults in a temporary folder, as its own process, with an
    API key for the batch tenant and one for the interactive tenant."""

    def __init__(self, args, log: Path):
        self.args, self.log = args, log
        self.folder = Path(tempfile.mkdtemp(prefix="berth-interactive-"))
        self.port, self.metrics_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "BERTH_DATABASE_URL": f"sqlite:///{self.folder}/berth.db",
                    "BERTH_STORAGE_URL": f"file://{self.folder}/store", "BERTH_BROKER_URL": "",
                    "BERTH_METRICS_PORT": str(self.metrics_port), "BERTH_DTYPE": args.dtype,
                    "BERTH_THREADS": str(args.threads), "BERTH_MODEL": args.model}
        if args.kv_memory != "auto":
            self.env["BERTH_KV_MEMORY"] = args.kv_memory
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> BerthServe:
        from jobs.http.keys import create_key
        from jobs.records.db import close_database, open_database

        url = self.env["BERTH_DATABASE_URL"]
        self.keys = {tenant: create_key(open_database(url), tenant) for tenant in ("batch", "live")}
        close_database(url)
        self.process = subprocess.Popen([sys.executable, "-m", "jobs.cli", "serve", "--port", str(self.port)],
                                        env=self.env, cwd=self.folder, stdout=open(self.log, "w"),
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                self.model = self._get("/v1/models")["data"][0]["id"]
                scrape(self.metrics_url)
                break
            except (OSError, urllib.error.URLError, KeyError, IndexError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"berth serve did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.process, 90)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _get(self, path: str, key: str | None = None) -> dict:
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {key or self.keys['live']}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys["batch"], max_retries=2, timeout=600)

    def batch_tokens(self) -> float:
        return scrape(self.metrics_url).get('berth_tenant_output_tokens_total{tenant="batch"}', 0.0)

    def wait_quiet(self, seconds: float = 5.0) -> None:
        """Until every tenant's generated-token counter has stood still for ``seconds`` (the worker's
        gauges change only when it steps, so an idle engine is told by its counters)."""
        deadline = time.monotonic() + START_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            now = scrape(self.metrics_url).get("berth_output_tokens_total", 0.0)
            if now == last:
                return
            last = now
            time.sleep(seconds)


class BerthBatchLoad:
    """A Batch API job of ``lines`` requests (the batch workload repeated) as a context manager:
    submitted, then waited for until its tokens flow and ``settle`` seconds more; cancelled on leaving,
    and the engine waited for until it is empty."""

    def __init__(self, server: BerthServe, request_file: Path, settle: float):
        self.server, self.request_file, self.settle = server, request_file, settle

    def __enter__(self) -> BerthBatchLoad:
        client = self.server.client()
        with open(self.request_file, "rb") as f:
            upload = client.files.create(file=f, purpose="batch")
        self.batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                           completion_window="24h")
        before = self.server.batch_tokens()
        deadline = time.monotonic() + START_TIMEOUT
        while self.server.batch_tokens() == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {self.batch.id} generated nothing in {START_TIMEOUT:.0f} s: "
                                   f"{client.batches.retrieve(self.batch.id)}")
            time.sleep(0.2)
        settle(self.tokens, self.settle)
        return self

    def tokens(self) -> float:
        return self.server.batch_tokens()

    def still_running(self) -> bool:
        return self.server.client().batches.retrieve(self.batch.id).status == "in_progress"

    def __exit__(self, *exc) -> None:
        client = self.server.client()
        if client.batches.retrieve(self.batch.id).status in ("validating", "in_progress", "finalizing"):
            client.batches.cancel(self.batch.id)
        deadline = time.monotonic() + START_TIMEOUT
        while client.batches.retrieve(self.batch.id).status not in FINAL and time.monotonic() < deadline:
            time.sleep(0.5)
        self.server.wait_quiet()


def settle(tokens, seconds: float, window: float = 5.0, tolerance: float = 0.15) -> None:
    """Wait until a batch load is past its first wave: its tokens/s over two successive ``window``s
    within ``tolerance`` of each other (the first prompts of a new load are all prefilled at once, so
    its first tokens come long before its steady rate), then ``seconds`` more."""
    deadline, previous = time.monotonic() + START_TIMEOUT, None
    while time.monotonic() < deadline:
        before = tokens()
        time.sleep(window)
        rate = (tokens() - before) / window
        if previous and rate and abs(rate - previous) <= tolerance * previous:
            break
        previous = rate
    time.sleep(seconds)


# ---------------------------------------------------------------- llama-server
class LlamaBatchLoad:
    """``clients`` threads, each sending the batch requests one after another to llama-server's
    ``/completion``, streamed so that every generated token is counted as it comes."""

    def __init__(self, url: str, workload: Workload, clients: int, settle: float):
        self.url, self.workload, self.clients, self.settle = url, workload, clients, settle
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.count, self.next_request, self.errors = 0, 0, []

    def __enter__(self) -> LlamaBatchLoad:
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + START_TIMEOUT
        while self.tokens() == 0:
            if self.errors or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server batch load generated nothing: {self.errors[:3]}")
            time.sleep(0.2)
        settle(self.tokens, self.settle)
        return self

    def _client(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                k = self.next_request % len(self.workload)
                self.next_request += 1
            body = {"prompt": self.workload.prompts[k], "n_predict": self.workload.output_lens[k], "temperature": 0,
                    "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": True}
            try:
                for event in sse_events(f"{self.url}/completion", body, None, stop=self.stop):
                    n = len(event.get("tokens") or []) or (1 if event.get("content") else 0)
                    with self.lock:
                        self.count += n
            except Exception as exc:  # noqa: BLE001 (reported, and the load goes on)
                if not self.stop.is_set():
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.5)

    def tokens(self) -> float:
        with self.lock:
            return self.count

    def still_running(self) -> bool:
        return not self.stop.is_set()

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def llama_args(args, workload: Workload, slots: int) -> list[str]:
    """Per-slot KV streams long enough for any batch or chat request (prompt, template, output)."""
    longest = max(PROMPT_LEN_RANGE[1] + 64 + args.interactive_tokens, PROMPT_LEN_RANGE[1] + OUTPUT_LEN_RANGE[1])
    kv = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    return ["--parallel", str(slots), "-c", str(slots * _round_up(longest, 256)), "--no-kv-unified",
            "-t", str(args.threads), "-tb", str(args.threads), "--cont-batching", "-ctk", kv, "-ctv", kv,
            "--cache-ram", "0", "--no-webui"]


# ---------------------------------------------------------------- phases
def phase_batch(load_factory, duration: float) -> dict:
    """Batch alone: its tokens/s over ``duration`` seconds once settled."""
    with load_factory() as load:
        before, t0, load_before = load.tokens(), time.perf_counter(), os.getloadavg()[0]
        time.sleep(duration)
        tokens, seconds = load.tokens() - before, time.perf_counter() - t0
        ran_dry = not load.still_running()
    return {"seconds": round(seconds, 2), "batch_tokens": int(tokens), "batch_tokens_per_s": round(tokens / seconds, 2),
            "batch_ran_dry": ran_dry, "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def phase_interactive(url: str, stream: InteractiveStream, key: str | None, max_tokens: int, load_factory=None) -> dict:
    """The interactive stream, alone or (``load_factory``) beside a settled batch load whose tokens/s
    is read over the stream's nominal window (``--duration`` from its start; stragglers then finish
    with the load still on)."""
    load_before = round(os.getloadavg()[0], 2)
    if load_factory is None:
        figures = latency_figures(run_stream(url, stream, key), max_tokens)
        return {**figures, "load_average_1m": [load_before, round(os.getloadavg()[0], 2)]}
    window = {}
    with load_factory() as load:
        def start():
            window["t0"], window["before"] = time.perf_counter(), load.tokens()

        def end():
            window["seconds"], window["tokens"] = time.perf_counter() - window["t0"], load.tokens() - window["before"]
            window["ran_dry"] = not load.still_running()

        results = run_stream(url, stream, key, on_start=start, on_end=end)
    seconds, tokens, ran_dry = window["seconds"], window["tokens"], window["ran_dry"]
    figures = latency_figures(results, max_tokens)
    figures.update({"seconds": round(seconds, 2), "batch_tokens": int(tokens),
                    "batch_tokens_per_s": round(tokens / seconds, 2), "batch_ran_dry": ran_dry,
                    "load_average_1m": [load_before, round(os.getloadavg()[0], 2)]})
    return figures


def ratios(phases: dict) -> dict:
    """Under batch load / alone (TTFT p99, ITL p99, TPOT p99) and batch with / without interactive load."""
    alone, both, batch = phases.get("interactive_alone", {}), phases.get("both", {}), phases.get("batch_alone", {})
    out = {}
    for name in ("ttft", "itl", "tpot"):
        if name in alone and name in both:
            out[f"{name}_p99_both_over_alone"] = round(both[name]["p99_ms"] / alone[name]["p99_ms"], 3)
    if batch.get("batch_tokens_per_s") and "batch_tokens_per_s" in both:
        out["batch_with_over_without"] = round(both["batch_tokens_per_s"] / batch["batch_tokens_per_s"], 3)
    return out


def goals(r: dict) -> dict:
    return {f"TTFT p99 under load <= {GOALS['ttft_p99']}x idle":
                r.get("ttft_p99_both_over_alone", 1e9) <= GOALS["ttft_p99"],
            f"ITL p99 under load <= {GOALS['itl_p99']}x idle":
                r.get("itl_p99_both_over_alone", 1e9) <= GOALS["itl_p99"],
            f"batch with interactive >= {GOALS['batch']}x alone": r.get("batch_with_over_without", 0) >= GOALS["batch"]}


def run_berth(args, batch_file: Path, tokenizer, log: Path) -> tuple[dict, float]:
    """berth's three phases; returns them and the interactive rate used."""
    phases = {}
    with BerthServe(args, log) as server:
        load = lambda: BerthBatchLoad(server, batch_file, args.settle)  # noqa: E731
        print(f"[{clock()}] berth: batch alone", flush=True)
        phases["batch_alone"] = phase_batch(load, args.duration)
        print(f"[{clock()}] berth: batch alone {phases['batch_alone']['batch_tokens_per_s']:.1f} tok/s", flush=True)
        capacity = phases["batch_alone"]["batch_tokens_per_s"]
        if not args.rate and not capacity:
            raise RuntimeError("the batch job generated no tokens within the phase (a machine too busy for steps "
                               "to finish within --duration?): no capacity to derive the rate from; pass --rate")
        rate = args.rate or args.load_share * capacity / args.interactive_tokens
        stream = make_stream(tokenizer, rate, args.duration, args.interactive_tokens, args.seed, server.model)
        if len(stream.arrivals) < FEW_REQUESTS:
            print(f"note: {len(stream.arrivals)} interactive requests a phase: too few for a p99 worth the name "
                  "(a longer --duration, or --rate)", flush=True)
        url = f"{server.url}/v1/chat/completions"
        print(f"[{clock()}] berth: interactive alone ({len(stream.arrivals)} requests at {rate:.3f}/s)", flush=True)
        phases["interactive_alone"] = phase_interactive(url, stream, server.keys["live"], args.interactive_tokens)
        print(f"[{clock()}] berth: both", flush=True)
        phases["both"] = phase_interactive(url, stream, server.keys["live"], args.interactive_tokens, load)
    return phases, rate


def run_llama(args, batch: Workload, tokenizer, rate: float, log: Path) -> dict:
    """llama-server's three phases at the same interactive rate (the same stream)."""
    llama_cpp_build.build(jobs=args.jobs)
    model = llama_cpp_build.f32_gguf(args.model, out_type={"float32": "F32", "bfloat16": "BF16"}[args.dtype])
    slots = args.llama_batch_clients + args.llama_spare_slots
    phases = {}
    with LlamaServer(model, llama_args(args, batch, slots), log) as server:
        load = lambda: LlamaBatchLoad(server.url, batch, args.llama_batch_clients, args.settle)  # noqa: E731
        print(f"[{clock()}] llama-server: batch alone", flush=True)
        phases["batch_alone"] = phase_batch(load, args.duration)
        print(f"[{clock()}] llama-server: batch alone {phases['batch_alone']['batch_tokens_per_s']:.1f} tok/s",
              flush=True)
        stream = make_stream(tokenizer, rate, args.duration, args.interactive_tokens, args.seed, "model")
        url = f"{server.url}/v1/chat/completions"
        print(f"[{clock()}] llama-server: interactive alone", flush=True)
        phases["interactive_alone"] = phase_interactive(url, stream, None, args.interactive_tokens)
        print(f"[{clock()}] llama-server: both", flush=True)
        phases["both"] = phase_interactive(url, stream, None, args.interactive_tokens, load)
        phases["server"] = {"model": str(model), "slots": slots, "args": server.args}
    return phases


# ---------------------------------------------------------------- command line and report
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both servers' compute threads")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of each phase (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="30 s phases, 5 s settling")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds a batch load runs before a phase is measured (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="interactive requests/s (default: 0 = --load-share of berth's batch-alone capacity)")
    parser.add_argument("--load-share", type=float, default=0.1,
                        help="interactive output tokens/s as a share of berth's batch-alone tokens/s "
                             "(default: %(default)s)")
    parser.add_argument("--interactive-tokens", type=int, default=64, help="output tokens of each chat request")
    parser.add_argument("--batch-lines", type=int, default=0,
                        help="lines of each berth batch job (default: enough for 4,000 tok/s over a phase)")
    parser.add_argument("--kv-memory", default="auto", help="berth's --kv-memory (default: berth serve's own auto)")
    parser.add_argument("--llama-batch-clients", type=int, default=64,
                        help="concurrent batch requests against llama-server (default: %(default)s)")
    parser.add_argument("--llama-spare-slots", type=int, default=16,
                        help="llama-server slots beyond the batch clients', for interactive requests")
    parser.add_argument("--skip", choices=("berth", "llama"), help="leave one system out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs if llama.cpp must be built")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.settle = 30.0, 5.0
    args.model = args.model or default_model_path()
    if args.out is None:
        args.out = Path("benchmarks/results") / f"interactive-load-{args.dtype}{'-quick' if args.quick else ''}.json"
    if args.skip == "berth" and not args.rate:
        parser.error("--skip berth needs --rate (the default rate comes from berth's measured capacity)")
    mean_output = sum(OUTPUT_LEN_RANGE) / 2
    args.batch_lines = args.batch_lines or int(4000 * (args.duration + args.settle + 30) / mean_output)
    return args


def print_report(report: dict) -> None:
    print(f"\nCPU: {machine_line(report['machine'])}, {report['dtype']}; "
          f"{report['duration']:.0f} s phases; interactive {report['rate']:.3f} req/s x "
          f"{report['interactive_tokens']} tokens")
    print(f"{'system':<14}{'phase':<19}{'req':>5}{'err':>5}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>9}"
          f"{'TPOT p50':>10}{'p99':>9}{'batch tok/s':>13}")
    for system, phases in report["systems"].items():
        for phase in ("batch_alone", "interactive_alone", "both"):
            p = phases.get(phase)
            if p is None:
                continue
            cell = lambda name, q: f"{p[name][q]:.0f}" if name in p else "-"  # noqa: E731
            batch = f"{p['batch_tokens_per_s']:.1f}{' (dry)' if p.get('batch_ran_dry') else ''}" \
                if "batch_tokens_per_s" in p else "-"
            print(f"{system:<14}{phase:<19}{p.get('requests', '-'):>5}{p.get('errors', '-'):>5}"
                  f"{cell('ttft', 'p50_ms'):>10}{cell('ttft', 'p99_ms'):>9}{cell('itl', 'p50_ms'):>9}"
                  f"{cell('itl', 'p99_ms'):>9}{cell('tpot', 'p50_ms'):>10}{cell('tpot', 'p99_ms'):>9}{batch:>13}")
        print(f"{system:<14}ratios: {phases.get('ratios', {})}")
    for goal, met in report.get("goals", {}).items():
        print(f"berth goal {goal}: {'met' if met else 'NOT met'}")
    print("(milliseconds; ITL is per content chunk, TPOT per token)")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from worker.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    batch = make_workload(tokenizer, BATCH_WORKLOAD, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    batch_file = args.out.with_suffix(".batch.jsonl")
    model_name = Settings(model=args.model).served_model_name()
    with open(batch_file, "w") as f:
        for i in range(args.batch_lines):
            k = i % len(batch)
            f.write(json.dumps(batch_line(f"request-{i}", batch.prompts[k], batch.output_lens[k], model_name)) + "\n")
    systems, rate = {}, args.rate
    if args.skip != "berth":
        systems["berth"], rate = run_berth(args, batch_file, tokenizer, args.out.with_suffix(".berth.log"))
    if args.skip != "llama":
        systems["llama-server"] = run_llama(args, batch, tokenizer, rate, args.out.with_suffix(".llama-server.log"))
    batch_file.unlink()
    for phases in systems.values():
        phases["ratios"] = ratios(phases)
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "dtype": args.dtype, "quick": args.quick,
              "model": args.model, "machine": machine_info(args.threads), "duration": args.duration,
              "settle": args.settle, "rate": round(rate, 4), "load_share": None if args.rate else args.load_share,
              "interactive_tokens": args.interactive_tokens, "batch_lines": args.batch_lines,
              "llama_batch_clients": args.llama_batch_clients, "systems": systems}
    if "berth" in systems:
        report["goals"] = goals(systems["berth"]["ratios"])
    print_report(report)
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
