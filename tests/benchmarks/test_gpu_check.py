"""benchmarks/gpu_check.py, the GPU day's one prepared run: its ``--smoke`` on this machine runs every part at
toy sizes and writes one JSON in which each part has a status, those that need CUDA skipped with a reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_smoke_run_writes_every_part_with_a_status(tmp_path):
    out = tmp_path / "gpu_check.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert list(parts) == ["cuda_tests", "kernels_bench", "engine_8b", "fp8_and_swap", "simulated"]
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part.get("error"), part.get("traceback"))
        assert part["seconds"] >= 0
        if part["status"] == "skipped":
            assert part["reason"], name
    assert report["smoke"] and report["total_s"] <= elapsed
    # the CUDA parts say why they did not run; the others ran the same steps at toy sizes
    assert parts["kernels_bench"]["status"] == "skipped" and "CUDA" in parts["kernels_bench"]["reason"]
    assert parts["cuda_tests"]["status"] == "skipped"
    assert parts["cuda_tests"]["details"]["tests"] == parts["cuda_tests"]["details"]["skipped"] > 0
    runs = parts["engine_8b"]["runs"]
    assert [(r["overlap"], r["cuda_graphs"]) for r in runs[:4]] == [("on", True), ("on", False), ("off", True),
                                                                    ("off", False)]
    for run in runs:
        assert run["output_tokens"] == run["requests"] * parts["engine_8b"]["output"]
        assert run["tokens_per_s"] > 0 and run["host_ms_per_step"] > 0
        assert run["graph_replays"] == 0  # the CPU never replays a graph
    assert parts["fp8_and_swap"]["fp8"]["status"] == "skipped"
    swap = parts["fp8_and_swap"]["swap"]
    assert swap["equal"] and swap["preemptions"]["swap"] > 0
    assert set(parts["simulated"]["engine_loop"]["median"]) == {"on", "off"}
