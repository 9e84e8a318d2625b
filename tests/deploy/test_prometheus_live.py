"""berth's dashboard and alert rules against a real Prometheus scraping real processes (issue 39: Grafana
cannot be installed here, Prometheus can). Debian's `prometheus` runs on 127.0.0.1 with berth's rules
(deploy/prometheus/berth-rules.yml), scraping every second an engine worker (`berth worker`) and `berth
serve` (its engine worker and its own figures: the jobs table, the interactive limits) on the embedded
defaults, while they run a small batch job on the default model and a tenant's chat and completions, one
of them past its tokens per minute. Then, through Prometheus's HTTP API:

- every panel query of deploy/grafana/berth.json, Grafana's variables filled in as Grafana would for a
  graph of the run, finds a number (a panel over a metric nobody exports, or a label that is not there,
  stays empty in Grafana without a word);
- every alert rule loaded and evaluates without an error, each alert expression reads metrics that were
  there, and none says anything of this healthy run: no alert pending or firing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import openai
import pytest
import yaml

from tests.support.dashboard import grafana_variables, panels, with_variables
from tests.support.exported_metrics import metric_names_in
from tests.support.paths import ROOT
from tests.support.processes import free_port, spawn

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install "
                                 "prometheus; the README's test command installs it)"),
              pytest.mark.slow]  # its servers take tens of seconds to start: the suite starts it first

RULES = ROOT / "deploy" / "prometheus" / "berth-rules.yml"
SCRAPE = 1  # seconds between scrapes, and between rule evaluations
TIMEOUT = 120.0  # seconds any one wait may take, on a busy machine
LINES, MAX_TOKENS = 24, 12  # the first batch job's; a job that ends before its progress was scraped is followed
# by one twice its size
FINAL = ("completed", "failed", "expired", "cancelled")
INTERACTIVE_TOKENS_PER_MINUTE = 60  # the interactive tenant's limit: its third small request is refused


def _get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


def _wait(what: str, check, procs: dict, timeout: float = TIMEOUT, interval: float = 0.25):
    """Poll ``check()`` until it returns something true (returned); fail naming ``what``, or a process that died."""
    deadline = time.monotonic() + timeout
    while True:
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}) waiting for {what}: see its log"
        try:
            found = check()
        except (OSError, urllib.error.URLError, openai.APIConnectionError):  # not serving yet
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s"
        time.sleep(interval)


@dataclass
class Prometheus:
    url: str

    def api(self, path: str, **params) -> dict:
        answer = _get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}")
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float) -> list:
        return self.api("query_range", query=expr, start=start, end=end, step=SCRAPE)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


@dataclass
class Run:
    prometheus: Prometheus
    start: float  # the run's window, Unix seconds: from Prometheus's start
    ready: float  # ... from both engine workers' first scrape on the queue (before, berth_broker_up is 0)
    end: float
    jobs: int  # batch jobs it took to have a live job's progress scraped
    logs: Path


def _numbers(result: list) -> list[float]:
    return [float(v) for series in result for _, v in series["values"] if not math.isnan(float(v))]


def _batch_file(path: Path, lines: int) -> Path:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    path.write_text("".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {**body, "prompt": f"Item {i}: the quick brown fox"}}) + "\n"
                            for i in range(lines)))
    return path


def _prometheus_config(path: Path, worker_port: int, serve_port: int) -> Path:
    """deploy/prometheus/prometheus.yml's jobs and rules, on this machine's ports, scraped every second."""
    path.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE}s", "scrape_timeout": f"{SCRAPE}s",
                   "evaluation_interval": f"{SCRAPE}s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "berth-worker", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
            {"job_name": "berth-serve", "static_configs": [{"targets": [f"127.0.0.1:{serve_port}"]}]},
        ]}))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from jobs import api
    from jobs.http.keys import create_key
    from jobs.records.db import open_database
    from worker.config import Settings

    tmp = tmp_path_factory.mktemp("prometheus-live")
    settings = Settings(database_url=f"sqlite:///{tmp / 'berth.db'}", storage_url=f"file://{tmp / 'store'}")
    alice = create_key(open_database(settings.database_url), "alice")  # the batch job's tenant
    bob = create_key(open_database(settings.database_url), "bob")  # chat and completions
    api.set_tenant_interactive_limits("bob", settings, tokens_per_minute=INTERACTIVE_TOKENS_PER_MINUTE)
    worker_port, serve_metrics, serve_port, prometheus_port = free_port(), free_port(), free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("BERTH_")},  # the embedded defaults
           "BERTH_DATABASE_URL": settings.database_url, "BERTH_STORAGE_URL": settings.storage_url,
           "BERTH_THREADS": "1", "BERTH_MAX_NUM_SEQS": "2", "BERTH_KV_MEMORY": "64MiB"}
    berth = [sys.executable, "-m", "jobs.cli"]
    procs = {}
    try:
        procs["prometheus"] = spawn(
            [PROMETHEUS, f"--config.file={_prometheus_config(tmp / 'prometheus.yml', worker_port, serve_metrics)}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            env, tmp / "prometheus.log")
        procs["berth worker"] = spawn([*berth, "worker", "--metrics-port", str(worker_port)], env, tmp / "worker.log")
        procs["berth serve"] = spawn([*berth, "serve", "--port", str(serve_port)],
                                     {**env, "BERTH_METRICS_PORT": str(serve_metrics)}, tmp / "serve.log")
        prometheus = Prometheus(f"http://127.0.0.1:{prometheus_port}")
        _wait("ready Prometheus", lambda: urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=5), procs)
        start = time.time()
        _wait("berth serve answering", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{serve_port}/openapi.json", timeout=5), procs)
        # both engine workers connected to the queue: the run's healthy state, where no alert has a word to say
        _wait("both engine workers scraped, on the queue", lambda: prometheus.value(
            'count(berth_broker_up{job=~"berth-worker|berth-serve"} == 1)') == 2, procs)
        ready = time.time()

        base_url = f"http://127.0.0.1:{serve_port}/v1"
        batches = openai.OpenAI(base_url=base_url, api_key=alice, max_retries=0, timeout=60)
        chat = openai.OpenAI(base_url=base_url, api_key=bob, max_retries=0, timeout=60)
        lines, jobs = LINES, 0
        while True:  # until a live job's progress was scraped: its requests done so far and expected finish
            jobs += 1
            with open(_batch_file(tmp / f"batch-{jobs}.jsonl", lines), "rb") as f:
                upload = batches.files.create(file=f, purpose="batch")
            batch = batches.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                           completion_window="24h")
            if jobs == 1:  # bob's chat and completions while the batch runs, till one is refused a 429
                stream = chat.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=6,
                                                      messages=[{"role": "user", "content": "Hi"}])
                assert [c for c in stream][-1].choices[0].finish_reason in ("stop", "length")
                _wait("bob's 429s scraped at 0", lambda: prometheus.query(
                    'berth_interactive_rate_limited_total{tenant="bob"} == 0'), procs)  # so rate() sees the first
                with pytest.raises(openai.RateLimitError):
                    for _ in range(10):
                        chat.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon", max_tokens=6)
            expected = f'berth_job_expected_finish_timestamp_seconds{{job_id="{batch.id}"}}'

            def scraped_or_over(job_id=batch.id, expected=expected):
                if prometheus.query(expected):
                    return "scraped"
                return batches.batches.retrieve(job_id).status in FINAL and "over"

            if _wait(f"progress of job {batch.id}", scraped_or_over, procs) == "scraped":
                break
            assert jobs < 4, f"{jobs} jobs ended before Prometheus scraped one's expected finish"
            lines *= 2
        done = _wait(f"end of job {batch.id}", lambda: (b := batches.batches.retrieve(batch.id)).status in FINAL and b,
                     procs)
        assert done.status == "completed" and done.request_counts.completed == lines, done
        # the finished job as Prometheus saw it, and the rules evaluated on it
        _wait("the finished job scraped", lambda: prometheus.value(f'max(berth_jobs{{state="completed"}}) == {jobs}'),
              procs)
        scraped = time.time()
        _wait("rules evaluated since", lambda: all(
            _evaluated_at(rule) > scraped for g in prometheus.api("rules")["groups"] for rule in g["rules"]), procs)
        yield Run(prometheus, start, ready, time.time(), jobs, tmp)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _evaluated_at(rule: dict) -> float:
    """A rule's last evaluation, Unix seconds (0 before its first): RFC 3339 to the nanosecond, in
    Prometheus's time zone."""
    m = re.fullmatch(r"([\d-]+T[\d:]+)(\.\d+)?(Z|[+-][\d:]+)", rule.get("lastEvaluation", ""))
    if not m or m.group(1).startswith("0001"):
        return 0.0
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(m.group(2) or 0)


def test_every_dashboard_panel_finds_data(run):
    """Each query of each panel, as Grafana would ask for a graph of the run a point a second, has a number
    (not only NaN); a share (a panel in percent) is between 0 and 1."""
    variables = grafana_variables(step=SCRAPE, scrape_interval=SCRAPE, range_seconds=run.end - run.start)
    empty, outside = [], []
    for panel in panels():
        share = panel.get("fieldConfig", {}).get("defaults", {}).get("unit") == "percentunit"
        for target in panel["targets"]:
            numbers = _numbers(run.prometheus.query_range(with_variables(target["expr"], variables), run.start,
                                                          run.end))
            if not numbers:
                empty.append(f"{panel['title']!r}: {target['expr']}")
            elif share and not 0 <= min(numbers) <= max(numbers) <= 1 + 1e-9:
                outside.append(f"{panel['title']!r} from {min(numbers):g} to {max(numbers):g}: {target['expr']}")
    assert not empty, "panels without data:\n" + "\n".join(empty) + f"\n(the processes' logs: {run.logs})"
    assert not outside, "shares outside 0 to 1:\n" + "\n".join(outside)


def _alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_every_rule_loads_and_evaluates_without_error(run):
    loaded = {r["name"]: r for g in run.prometheus.api("rules")["groups"] for r in g["rules"]}
    assert set(loaded) == {a["alert"] for a in _alerts()}
    for name, rule in loaded.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)


def test_no_alert_says_anything_of_a_healthy_run(run):
    """No alert pending or firing; each alert's expression empty at every second of the run since both
    engine workers were on the queue, and not for want of its metrics: each one it reads was there."""
    assert run.prometheus.api("alerts")["alerts"] == []
    for alert in _alerts():
        said = run.prometheus.query_range(alert["expr"], run.ready, run.end)
        assert said == [], f"{alert['alert']} has something to say of a healthy run: {said}"
        for name in sorted(metric_names_in(alert["expr"])):
            assert run.prometheus.api("series", **{"match[]": name, "start": run.ready, "end": run.end}), \
                f"{alert['alert']} reads {name}, which nobody exported in the run"



def test_the_429_shows_on_its_panel(run):
    """bob's requests past his tokens per minute: the first 429 of a tenant is a rate above 0, not a
    counter that appears at 1."""
    [expr] = [t["expr"] for p in panels() for t in p["targets"] if "berth_interactive_rate_limited_total" in t["expr"]]
    variables = grafana_variables(step=SCRAPE, scrape_interval=SCRAPE, range_seconds=run.end - run.start)
    shown = run.prometheus.query_range(with_variables(expr, variables), run.start, run.end)
    assert {(s["metric"]["tenant"], s["metric"]["reason"]) for s in shown} == {
        ("bob", "live_requests"), ("bob", "tokens_per_minute")}
    assert max(_numbers([s for s in shown if s["metric"]["reason"] == "tokens_per_minute"])) > 0
