"""`berth worker` says what it is doing while it starts, on stderr with no logging set up by the user:
the model it loads, how long the weights took, the KV cache it reserved, and when it is ready, all
before it runs a request. A worker restarted after a crash is otherwise silent for its whole start."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from jobs import api
from tests.support.jobs_env import (
    tiny_env,
    tiny_settings,
    work_in_process_until_over,
    write_requests,
)
from worker.config import KV_AUTO_SHARE
from worker.engine.model_runner import available_memory

STARTUP_LINES = [
    r"INFO berth\.engine: loading model (?P<path>\S+) \(float32, cpu\)",
    r"INFO berth\.engine: weights loaded in [0-9.]+s: llama, 2 layers",
    r"INFO berth\.engine: KV cache: (?P<blocks>\d+) blocks of 16 tokens in float32 \((?P<mib>\d+) MiB reserved",
    r"INFO berth\.engine: engine ready \([0-9.]+s since the process started\)",
    r"INFO berth\.worker: worker \S+ consuming .*: ready, [0-9.]+s since the process started",
]


def test_the_worker_logs_its_start_before_it_runs_a_request(tmp_path, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    job = api.submit(write_requests(tmp_path / "one.jsonl", 1), settings)
    env = {**os.environ, **tiny_env(settings)}
    del env["BERTH_KV_MEMORY"]  # the default a user gets: sized by the model and max_num_seqs
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker"], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=log)
    work_in_process_until_over(proc, settings, job.id, log_path)
    assert api.status(job.id, settings).completed == 1

    lines = log_path.read_text().splitlines()
    found = []
    for pattern in STARTUP_LINES:
        hits = [(i, m) for i, line in enumerate(lines) if (m := re.search(pattern, line))]
        assert len(hits) == 1, f"want one line like {pattern!r} in:\n" + "\n".join(lines)
        found.append(hits[0])
    assert [i for i, _ in found] == sorted(i for i, _ in found), "the start-up lines came out of order"
    assert found[0][1]["path"] == str(tiny_llama_dir)
    # The tiny model: 2 layers, 2 kv heads of 16, float32: 8 KiB a block; 2048 tokens = 128 blocks a request.
    wanted = 256 * 128
    cap = int(KV_AUTO_SHARE * available_memory(torch.device("cpu")) // 8192)
    blocks = int(found[2][1]["blocks"])
    assert blocks == wanted if cap > 2 * wanted else 0 < blocks <= wanted
    assert int(found[2][1]["mib"]) == round(blocks * 8192 / 2**20)
