"""`berth run` stopped by Ctrl-C as a user lives it, on the embedded defaults (the current folder's
database, queue and files): the first Ctrl-C says what it does and lets the running requests finish,
a second stops at once; the job is left queued with what was done, the command says how to finish it,
and the same `berth run` again goes on with that job rather than submitting the file anew."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from jobs.cli import EXIT_INTERRUPTED
from tests.support.interrupted_runs import LINES
from tests.support.terminal import berth_in_a_terminal


def _jobs(folder: Path) -> list[tuple[str, str, int]]:
    """(id, status, completed) of every job in the folder's database; [] while it cannot be read."""
    try:
        with sqlite3.connect(f"file:{folder / 'berth.db'}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT id, status, completed FROM jobs ORDER BY created_at").fetchall()
    except sqlite3.Error:
        return []


def _done_at_least(folder: Path, count: int):
    return lambda _: any(done >= count for _, _, done in _jobs(folder))


def _texts(path: Path) -> dict[str, str]:
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
            for line in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_ctrl_c_leaves_the_job_queued_and_the_same_command_finishes_it(tmp_path, uninterrupted):
    src, never_stopped = uninterrupted  # the file itself, as the generate tests run it: the jobs live in tmp_path
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--kv-memory", "256MiB", "--max-num-seqs", "8"]

    # one Ctrl-C: said what it does, the running requests finish, the job stays
    code, text = berth_in_a_terminal(args, [_done_at_least(tmp_path, 3)], cwd=tmp_path)
    assert code == EXIT_INTERRUPTED and "Traceback" not in text, text[-3000:]
    assert "up to 60 s to finish them; Ctrl-C (SIGINT or SIGTERM) again to stop now" in text, text[-3000:]
    [(job_id, status, done)] = _jobs(tmp_path)
    assert status == "in_progress" and 3 <= done < LINES and not out.exists()
    last = text.strip().splitlines()[-1]
    assert last == (f"stopped: {job_id} left with {done} of {LINES} lines done, its other lines queued; "
                    f"`berth run {src} -o {out}` again goes on with it (or `berth worker`, then "
                    f"`berth results {job_id} -o {out}`)"), last

    # the same command: the same job; two Ctrl-C stop at once, handing the running requests back
    code, text = berth_in_a_terminal(args, [_done_at_least(tmp_path, done + 3), lambda t: "again to stop now" in t],
                                     cwd=tmp_path)
    assert f"going on with {job_id}, which an earlier run of in.jsonl left unfinished ({done} of {LINES}" in text
    assert code == EXIT_INTERRUPTED and "Traceback" not in text, text[-3000:]
    [(same_id, status, more)] = _jobs(tmp_path)
    assert same_id == job_id and status == "in_progress" and done + 3 <= more < LINES

    # and again to the end: every line once, as a run never stopped writes them (the engine alone, in this process)
    code, text = berth_in_a_terminal(args + ["--quiet"], cwd=tmp_path)
    assert code == 0, text[-3000:]
    [(same_id, status, finished)] = _jobs(tmp_path)
    assert (same_id, status, finished) == (job_id, "completed", LINES)
    assert _texts(out) == _texts(never_stopped)
    assert sorted(_texts(out)) == sorted(f"r{i}" for i in range(LINES))
