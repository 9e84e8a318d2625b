"""benchmarks/draft_model.py at toy sizes (``--quick``): both settings run, the draft model drafts, the outputs
are the same tokens, and the report carries acceptance, tokens/s of each, their ratio and the CPU's name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_reports_acceptance_rates_and_their_ratio(tmp_path):
    out = tmp_path / "draft_model.json"
    proc = subprocess.run([sys.executable, "benchmarks/draft_model.py", "--quick", "--models", str(tmp_path / "models"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["same_outputs"] is True and report["quick"] is True
    off, drafted = report["off"], report["drafted"]
    assert off["draft_tokens"] == 0 and drafted["draft_tokens"] > 0 and drafted["speculation"] == "draft:4"
    assert off["tokens_per_s"] > 0 and drafted["tokens_per_s"] > 0 and report["ratio_tokens_per_s"] > 0
    assert 0 <= report["acceptance"] <= 1 and report["machine"]["cpu_model"]
    assert report["draft_model"]["parameters"] < report["target_model"]["parameters"]
    assert "acceptance" in proc.stdout and "ratio draft/off" in proc.stdout
