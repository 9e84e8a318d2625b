"""benchmarks/deadlines.py at a toy size on the tiny random Llama: with deadlines the 1-hour job B, added
behind the 24-hour job A, finishes first; with one deadline for both it finishes last; both orderings make
the same tokens, and the report carries the throughput ratio and the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_finishes_the_one_hour_job_first_with_the_same_tokens(tmp_path, tiny_llama_dir):
    out = tmp_path / "deadlines.json"
    proc = subprocess.run([sys.executable, "benchmarks/deadlines.py", "--quick", "--model", str(tiny_llama_dir),
                           "--threads", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    [same], [deadlines] = report["runs"]["same"], report["runs"]["deadlines"]
    assert deadlines["jobs"]["B"]["finished_s"] < deadlines["jobs"]["A"]["finished_s"]
    assert same["jobs"]["A"]["finished_s"] < same["jobs"]["B"]["finished_s"]  # B waited behind A
    assert 0 < deadlines["jobs"]["B"]["arrived_s"] < deadlines["jobs"]["A"]["finished_s"]
    assert report["summary"]["b_first_with_deadlines"] and report["summary"]["outputs_identical"]
    assert same["output_tokens"] == deadlines["output_tokens"] == report["output_tokens"]
    assert report["summary"]["tokens_per_s_ratio"] > 0 and report["machine"]["cpu_model"]
    assert "outputs identical between the orderings: True" in proc.stdout
