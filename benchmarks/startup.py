"""How long berth takes to become ready, and what its KV cache holds in memory once it is.

A worker restarted after a crash pays its start-up again before it continues, so start-up is
recovery time too. This measures, for the code of this tree and for a baseline revision checked
out from git in the same run (``--baseline``, default the commit before the start-up work):

- ``generate``: seconds from process start to the end of ``berth generate`` on a one-request
  file with ``max_tokens=1`` (so the end is the first token plus writing one line), and the
  phases of that path run in one process: imports, reading the model, building the engine (model
  and KV cache), the first token;
- ``worker``: seconds from a ``berth worker`` process start (embedded defaults: SQLite, the
  embedded queue and a local folder, in a temporary folder) to its log line that it consumes
  (``ready``) and to its first generated token (the Prometheus counter ``berth_output_tokens_total``);
- ``respawn``: with ``berth worker --respawn`` (a parent that imported torch and the engine forks the
  worker), seconds from SIGKILL of the ready child to the next child's ``ready`` line, which is what a
  crash costs there (a baseline without ``--respawn`` shows none);
- ``commands``: seconds of the commands that read jobs and never run the engine (``berth status``,
  ``list``, ``--help``), each the best of three, on a job submitted to an embedded database;
- the KV cache's resident memory after start and after the first token: the pages of the cache
  tensors present in memory (``/proc/self/pagemap``), beside the bytes reserved;
- which heavy packages the generate path imported before its first token.

    python benchmarks/startup.py                    # this tree against 7fa1c06, best of 2
    python benchmarks/startup.py --repeat 3 --baseline HEAD~3

Caches are warm in both (the converted tokenizer, the C kernel, the model file in the page
cache): a first run after installing pays those once, and that is not what a restart pays.
Prints a table with after/before ratios and the CPU name; ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "7fa1c06"  # main when issue 23 (start-up: worker in 1 s, `berth status` in 0.5 s) was filed
HEAVY = ("transformers", "sqlalchemy", "celery", "kombu", "fastapi", "boto3", "jsonschema", "triton", "jinja2",
         "tokenizers", "gguf", "pydantic")

ONE_REQUEST = {"custom_id": "startup", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello"}],
                        "max_tokens": 1, "temperature": 0}}

# Run in a fresh process with the variant's tree first on sys.path: the phases of `berth generate`.
PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import jobs.cli
from worker.config import Settings
try:  # as `berth generate` does before torch's import (a baseline from before it has none)
    from worker.engine import heap_prefault
    heap_prefault.start(Settings())
except ImportError:
    pass
import jobs.hosting.generate
t1 = time.perf_counter()
try:
    from worker.engine.engine import DTYPES, Engine
    from worker.engine.request import SamplingParams
    from worker.model.loader import load_model
except ModuleNotFoundError:  # a baseline from before the wings (worker/engine/, worker/model/): one flat worker/
    from worker.engine import DTYPES, Engine
    from worker.model_loader import load_model
    from worker.request import SamplingParams
settings = Settings()
loaded = load_model(settings.model_path(), DTYPES[settings.dtype])
t2 = time.perf_counter()
engine = Engine(settings, loaded=loaded)
t3 = time.perf_counter()

def kv_resident():
    return sum(resident_bytes(t) for pair in engine.runner.kv_caches for t in pair)

kv_after_start = kv_resident()
t3b = time.perf_counter()
ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
ids = list(ids if isinstance(ids, list) else ids["input_ids"])
engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
t4 = time.perf_counter()
heavy = {name: name in sys.modules for name in HEAVY}
print("PHASES " + json.dumps({"imports": t1 - t0, "read_model": t2 - t1, "build_engine": t3 - t2,
                              "first_token": t4 - t3b, "kv_reserved": engine.runner.kv_bytes,
                              "kv_resident_after_start": kv_after_start, "kv_resident_after_token": kv_resident(),
                              "kv_blocks": engine.runner.num_blocks, "heavy_imports": heavy}))
"""


def resident_bytes(tensor) -> int:
    """Bytes of ``tensor``'s memory that are resident: its pages present in /proc/self/pagemap
    (bit 63), whatever mapping they belong to. A page never touched is not."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first, last = start // page, (start + tensor.numel() * tensor.element_size() - 1) // page
    present = 0
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        remaining = last - first + 1
        while remaining:
            chunk = f.read(8 * min(remaining, 1 << 16))
            entries = memoryview(chunk).cast("Q")
            present += sum(1 for e in entries if e >> 63)
            remaining -= len(entries)
    return present * page


def checkout(revision: str, into: Path) -> Path:
    """The files of ``revision`` (``git archive``: no worktree left behind)."""
    archive = into / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), revision], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def variant_env(tree: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_") or k == "BERTH_CACHE_DIR"}
    env["PYTHONPATH"] = str(tree)
    env["HOME"] = os.environ.get("HOME", str(home))
    return env


def _cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_generate(tree: Path, work: Path) -> tuple[float, float]:
    """Wall-clock and CPU seconds (user + system: steadier than wall-clock on a busy machine)."""
    requests = work / "one.jsonl"
    requests.write_text(json.dumps(ONE_REQUEST) + "\n")
    cpu, start = _cpu_seconds_of_children(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "jobs.cli", "generate", str(requests), "-o", str(work / "out.jsonl"),
                    "--quiet"], cwd=work, env=variant_env(tree, work), check=True, capture_output=True)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds_of_children() - cpu
    assert json.loads((work / "out.jsonl").read_text())["response"]["status_code"] == 200
    return seconds, cpu


def phases(tree: Path, work: Path) -> dict:
    script = f"import os\nHEAVY = {HEAVY!r}\n" + inspect.getsource(resident_bytes) + PHASES
    done = subprocess.run([sys.executable, "-c", script], cwd=work, env=variant_env(tree, work),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the phases script failed:\n{done.stderr[-3000:]}")
    out = done.stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("PHASES "))[7:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens_out(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
        text = r.read().decode()
    m = re.search(r"^berth_output_tokens_total (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def time_worker(tree: Path, work: Path, timeout: float = 300.0) -> dict:
    """A job of one request submitted first, then a worker started: seconds to ready and to its first token."""
    env = {**variant_env(tree, work), "BERTH_DATABASE_URL": f"sqlite:///{work / 'berth.db'}",
           "BERTH_STORAGE_URL": f"file://{work / 'store'}"}
    requests = work / "one.jsonl"
    requests.write_text(json.dumps(ONE_REQUEST) + "\n")
    subprocess.run([sys.executable, "-m", "jobs.cli", "submit", str(requests)], cwd=work, env=env, check=True,
                   capture_output=True)
    port = _free_port()
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", "--metrics-port", str(port)], cwd=work,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the worker died:\n" + "\n".join(text for _, text in lines[-20:]))
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"no token in {timeout}s")
            try:
                if _tokens_out(port) > 0:
                    first_token = time.perf_counter() - start
                    break
            except OSError:
                pass
            time.sleep(0.02)
    finally:
        stop(proc, reader)
    ready = next((t for t, text in lines if " consuming " in text), float("nan"))
    return {"ready": ready, "first_token": first_token, "log": [f"{t:6.2f}s {text}" for t, text in lines[:12]]}


def stop(proc: subprocess.Popen, reader: threading.Thread) -> None:
    """Stop a worker (SIGTERM, SIGKILL after 60 s) and the thread reading its log."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)


def time_respawn(tree: Path, work: Path, timeout: float = 300.0) -> dict | None:
    """``berth worker --respawn``: seconds from its start to the first child's ready line, and from SIGKILL
    of that child to the next child's; None where the tree has no ``--respawn``."""
    if not any((tree / "jobs" / where / "respawn.py").exists() for where in ("hosting", "")):  # moved in the house move
        return None
    env = {**variant_env(tree, work), "BERTH_DATABASE_URL": f"sqlite:///{work / 'berth.db'}",
           "BERTH_STORAGE_URL": f"file://{work / 'store'}"}
    lines: list[tuple[float, str]] = []
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker", "--respawn"], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter() - start, line.rstrip())
                                                          for line in proc.stderr), daemon=True)
    reader.start()

    def ready_lines() -> list[float]:
        return [t for t, text in list(lines) if " consuming " in text]

    def wait_for(n: int) -> float:
        while len(ready_lines()) < n:
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                raise RuntimeError("the respawning worker died or never got ready:\n" +
                                   "\n".join(text for _, text in lines[-20:]))
            time.sleep(0.005)
        return ready_lines()[n - 1]

    try:
        first_ready = wait_for(1)
        child = int(re.findall(r"worker child (\d+) started", "\n".join(text for _, text in lines))[-1])
        killed = time.perf_counter() - start
        os.kill(child, 9)
        respawned = wait_for(2)
    finally:
        stop(proc, reader)
    return {"ready": first_ready, "death_to_ready": respawned - killed}


COMMANDS = {"status": ["status", "{job}"], "list": ["list"], "help": ["--help"]}


def time_commands(tree: Path, work: Path, tries: int = 3) -> dict[str, dict[str, float]]:
    """Wall-clock and CPU seconds of each of ``COMMANDS`` (the best of ``tries``) on an embedded
    database holding one submitted job."""
    env = {**variant_env(tree, work), "BERTH_DATABASE_URL": f"sqlite:///{work / 'berth.db'}",
           "BERTH_STORAGE_URL": f"file://{work / 'store'}"}
    requests = work / "one.jsonl"
    requests.write_text(json.dumps(ONE_REQUEST) + "\n")
    job = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", str(requests)], cwd=work, env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    figures = {}
    for name, args in COMMANDS.items():
        walls, cpus = [], []
        for _ in range(tries):
            cpu, start = _cpu_seconds_of_children(), time.perf_counter()
            subprocess.run([sys.executable, "-m", "jobs.cli", *(a.format(job=job) for a in args)], cwd=work, env=env,
                           check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
            cpus.append(_cpu_seconds_of_children() - cpu)
        figures[name] = {"wall": min(walls), "cpu": min(cpus)}
    return figures


def one_run(tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as c, \
            tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as e:
        wall, cpu = time_generate(tree, Path(a))
        return {"generate": wall, "generate_cpu": cpu, "phases": phases(tree, Path(b)),
                "worker": time_worker(tree, Path(c)),
                "respawn": time_respawn(tree, Path(e)), "commands": time_commands(tree, Path(d))}


def summary(runs: list[dict]) -> dict:
    """The best of the runs of each figure (start-up on a busy machine only ever gets slower)."""
    best = min(runs, key=lambda r: r["generate"])
    return {"generate": min(r["generate"] for r in runs), "generate_cpu": min(r["generate_cpu"] for r in runs),
            "worker_ready": min(r["worker"]["ready"] for r in runs),
            "worker_first_token": min(r["worker"]["first_token"] for r in runs),
            "respawn": None if runs[0]["respawn"] is None else
            {k: min(r["respawn"][k] for r in runs) for k in ("ready", "death_to_ready")},
            "phases": {k: min(r["phases"][k] for r in runs)
                       for k in ("imports", "read_model", "build_engine", "first_token")},
            "kv": {k: best["phases"][k] for k in ("kv_reserved", "kv_resident_after_start",
                                                   "kv_resident_after_token", "kv_blocks")},
            "commands": {name: {k: min(r["commands"][name][k] for r in runs) for k in ("wall", "cpu")}
                         for name in COMMANDS},
            "heavy_imports": best["phases"]["heavy_imports"],
            "worker_log": runs[-1]["worker"]["log"], "runs": runs}


def report(before: dict, after: dict, baseline: str, machine: dict) -> None:
    mib = 1 << 20
    print(f"CPU: {machine_line(machine)}; best of the runs; baseline {baseline}")
    print(f"{'':38}{'before':>10}{'after':>10}{'after/before':>14}")
    rows = [("berth generate, 1 request, 1 token (s)", before["generate"], after["generate"]),
            ("  the same in CPU seconds (user+sys)", before["generate_cpu"], after["generate_cpu"]),
            ("berth worker: start to ready (s)", before["worker_ready"], after["worker_ready"]),
            ("berth worker: start to first token (s)", before["worker_first_token"], after["worker_first_token"])]
    rows += [(f"  phase: {k.replace('_', ' ')} (s)", before["phases"][k], after["phases"][k])
             for k in before["phases"]]
    for key, name in (("ready", "worker --respawn: start to ready (s)"),
                      ("death_to_ready", "  respawn: child SIGKILL to ready (s)")):
        rows.append((name, (before["respawn"] or {}).get(key, float("nan")),
                     (after["respawn"] or {}).get(key, float("nan"))))
    for name, args in COMMANDS.items():
        shown = " ".join(a.replace("{job}", "JOB") for a in args)
        rows += [(f"berth {shown} (s)", before["commands"][name]["wall"], after["commands"][name]["wall"]),
                 ("  the same in CPU seconds", before["commands"][name]["cpu"], after["commands"][name]["cpu"])]
    rows += [("KV cache reserved (MiB)", before["kv"]["kv_reserved"] / mib, after["kv"]["kv_reserved"] / mib),
             ("KV resident after start (MiB)", before["kv"]["kv_resident_after_start"] / mib,
              after["kv"]["kv_resident_after_start"] / mib),
             ("KV resident after 1st token (MiB)", before["kv"]["kv_resident_after_token"] / mib,
              after["kv"]["kv_resident_after_token"] / mib)]
    for name, b, a in rows:
        ratio = f"{a / b:14.2f}" if b and b == b else f"{'-':>14}"
        print(f"{name:38}{b:10.2f}{a:10.2f}{ratio}")
    print(f"KV blocks: before {before['kv']['kv_blocks']}, after {after['kv']['kv_blocks']}")
    for name, r in (("before", before), ("after", after)):
        loaded = [m for m, yes in r["heavy_imports"].items() if yes]
        print(f"imported before the first token ({name}): {', '.join(loaded)}")
    print("the worker's first log lines (after):")
    for line in after["worker_log"]:
        print("   ", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision measured as 'before'")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the best is shown")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = checkout(args.baseline, Path(tmp))
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.repeat):  # in turn, so that a busy spell of the machine falls on both
            runs["before"].append(one_run(base))
            runs["after"].append(one_run(ROOT))
        before, after = summary(runs["before"]), summary(runs["after"])
    machine = machine_info(os.cpu_count())  # berth's default, a thread a core: variant_env drops BERTH_THREADS
    report(before, after, args.baseline, machine)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "baseline": args.baseline, "before": before,
                                        "after": after}, indent=2))


if __name__ == "__main__":
    main()
