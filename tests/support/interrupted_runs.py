"""The file the Ctrl-C tests of ``berth generate`` and ``berth run`` stop and finish, and what a run never
stopped writes of it: made once per test process, in it (the engine on the loaded default model), the
reference both tests' finished outputs must equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LINES = 24


def interrupted_requests(path: Path, lines: int = LINES, max_tokens: int = 24) -> Path:
    """Greedy completions whose lengths differ, so that lines finish one after another."""
    with open(path, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "SmolLM2-135M-Instruct", "prompt": f"Item {i}: the number",
                                         "max_tokens": max_tokens + i % 7, "temperature": 0}}) + "\n")
    return path


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, smol_loaded) -> tuple[Path, Path]:
    """The requests file and a run's output of it, never stopped."""
    from jobs.hosting.generate import generate_file
    from worker.engine.engine import Engine

    folder = tmp_path_factory.mktemp("uninterrupted")
    src = interrupted_requests(folder / "in.jsonl")
    # all the lines at once (the commands tested run 8 at a time): a third of the steps, the same greedy tokens
    generate_file(src, folder / "out.jsonl", engine=Engine(loaded=smol_loaded, kv_memory="256MiB"), progress=False)
    return src, folder / "out.jsonl"
