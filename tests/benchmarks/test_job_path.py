"""benchmarks/job_path.py at a toy size on the embedded defaults: both systems run every request, the
report carries their rates, ratio and CPU a request, and ``--set`` reaches the settings (a key that is
no setting is refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/job_path.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_a_quick_run_on_the_embedded_defaults_reports_rates_ratio_and_cpu(tmp_path):
    out = tmp_path / "job_path.json"
    proc = _run("--quick", "--requests", "40", "--skip", "servers", "--set", "prefetch=16", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 40 and report["overrides"] == {"prefetch": "16"}
    assert set(report["summary"]) == {"engine", "embedded"}
    for name, s in report["summary"].items():
        assert s["requests_per_s"] > 0 and s["tokens_per_s"] > 0, name
    embedded = report["summary"]["embedded"]
    assert embedded["ratio_to_engine"] > 0
    assert {"process", "submit", "worker", "engine_step"} <= set(embedded["cpu_ms_per_request"])
    [round_] = report["by_round"]
    assert round_["systems"]["embedded"]["output_tokens"] == round_["systems"]["engine"]["output_tokens"] == 40 * 4
    assert "claim" in round_["systems"]["embedded"]["ledger"] and "record" in round_["systems"]["embedded"]["ledger"]
    phases = round_["systems"]["embedded"]["phases"]
    assert set(phases) == {"first_result", "queued", "last_result", "completed", "returned"}
    assert phases["first_result"] <= phases["last_result"] <= phases["completed"] <= phases["returned"]
    assert round_["systems"]["embedded"]["cpu"]["submit"] > 0  # the ingest's thread, counted apart from the worker


def test_set_takes_only_settings():
    proc = _run("--set", "no_such_setting=1", timeout=60)
    assert proc.returncode == 2 and "--set takes KEY=VALUE" in proc.stderr
