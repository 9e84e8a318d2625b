"""`berth generate` as a long run is lived: Ctrl-C (SIGINT from the terminal) at any moment keeps every
finished line and `--resume` completes the file to what an uninterrupted run writes; errors a user can
act on before the model loads; exit statuses a script can trust."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs.cli import EXIT_INTERRUPTED, EXIT_LINES_FAILED, main
from jobs.hosting.generate import GenerateInterrupted, generate_file, partial_path
from tests.support.interrupted_runs import interrupted_requests
from tests.support.terminal import berth_in_a_terminal
from worker.engine.engine import Engine

pytestmark = pytest.mark.slow  # tests of tens of seconds: the suite starts them first


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _answers(lines: list[str]) -> list[str]:
    """Output lines less the moment they were made (``created``), which no rerun repeats."""
    out = []
    for text in lines:
        line = json.loads(text)
        line["response"]["body"].pop("created")
        out.append(json.dumps(line, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def finished(uninterrupted):
    """An uninterrupted run's output: what every interrupted and resumed run must end with."""
    src, out = uninterrupted
    return src, _answers(_lines(out))


@pytest.mark.parametrize("moment", ["starting", "midway", "late"])
def test_ctrl_c_keeps_what_was_done_and_resume_finishes_the_same_file(tmp_path, finished, moment):
    """Ctrl-C while the model loads, after 3 of 24 lines, and with 8 lines to go (8 run at once: the last line
    has just been taken, a whole line's steps of window). (Sent 0.3 s after the start instead, a run on a busy
    machine once went on to complete all 24 lines, its Ctrl-C lost: 30 tries beside two busy loops stopped each
    time, by Python's own handler or berth's.)"""
    src, whole = finished
    out = tmp_path / "out.jsonl"
    partial = partial_path(out)
    done = {"starting": 0, "midway": 3, "late": len(whole) - 8}[moment]
    when = {"starting": lambda text: "loading model" in text,  # berth's handler in place, no line run yet
            "midway": lambda _: partial.exists() and len(_lines(partial)) >= done,
            "late": lambda _: partial.exists() and len(_lines(partial)) >= done}[moment]
    args = ["generate", str(src), "-o", str(out), "--kv-memory", "256MiB", "--max-num-seqs", "8"]
    code, text = berth_in_a_terminal(args, [when])
    assert not out.exists() and " completed" not in text, text[-2000:]  # stopped, not swallowed
    assert code == EXIT_INTERRUPTED and "Traceback" not in text, text[-2000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("stopped") and "--resume" in last, last
    kept = _answers(_lines(partial)) if partial.exists() else []
    assert set(kept) <= set(whole)  # every finished line kept whole, none made up
    assert len(kept) >= done
    code, text = berth_in_a_terminal(args + ["--resume", "--quiet"])
    assert code == 0, text[-2000:]
    assert _answers(_lines(out)) == whole and not partial.exists()
    assert f"({len(kept)} kept from the run before)" in text or not kept


def test_an_interrupted_run_raises_with_its_partial_file(tmp_path, smol_loaded, monkeypatch):
    src = interrupted_requests(tmp_path / "in.jsonl", 6)
    engine = Engine(loaded=smol_loaded, kv_memory="256MiB", max_num_seqs=2)
    steps = 0
    step = engine.step

    def interrupted_step():
        nonlocal steps
        steps += 1
        if steps == 40:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    with pytest.raises(GenerateInterrupted) as stop:
        generate_file(src, tmp_path / "out.jsonl", engine=engine, progress=False)
    assert stop.value.partial == tmp_path / "out.jsonl.partial"
    assert 0 < stop.value.summary.completed == len(_lines(stop.value.partial)) < 6
    engine.step = step
    done = generate_file(src, tmp_path / "out.jsonl", engine=engine, progress=False, resume=True)
    assert done.resumed == stop.value.summary.completed and done.completed == 6
    assert [json.loads(x)["custom_id"] for x in _lines(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(6)]


def test_an_output_folder_that_does_not_exist_is_said_before_the_model_loads(tmp_path):
    src = interrupted_requests(tmp_path / "in.jsonl", 1)
    result = CliRunner().invoke(main, ["generate", str(src), "-o", str(tmp_path / "nowhere" / "out.jsonl")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {tmp_path / 'nowhere' / 'out.jsonl'}: the folder {tmp_path / 'nowhere'} does not exist: create it, "
        "or give -o a path in a folder that does"]


def test_exit_status_says_when_lines_failed(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("a,b,c\n1,2,3\n")  # a CSV file: every line fails
    result = CliRunner().invoke(main, ["generate", str(bad), "-o", str(tmp_path / "o.jsonl"), "--quiet"])
    assert result.exit_code == EXIT_LINES_FAILED, result.output
    mixed = interrupted_requests(tmp_path / "mixed.jsonl", 2, max_tokens=2)
    with open(mixed, "a") as f:
        f.write("{not json\n")
    args = ["generate", str(mixed), "-o", str(tmp_path / "m.jsonl"), "--quiet"]
    assert CliRunner().invoke(main, args).exit_code == 0
    assert CliRunner().invoke(main, args + ["--fail-on-line-errors"]).exit_code == EXIT_LINES_FAILED


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("berth ")


def test_berth_run_and_serve_say_what_is_wrong_before_the_model_loads(tmp_path):
    import socket

    src = interrupted_requests(tmp_path / "in.jsonl", 1)
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(tmp_path / "no" / "out.jsonl")])
    assert result.exit_code == 1 and "the folder" in result.output and "does not exist" in result.output
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = CliRunner().invoke(main, ["serve", "--port", str(port), "--database-url",
                                           f"sqlite:///{tmp_path / 'b.db'}"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): another program holds it "
        f"(`ss -ltnp 'sport = :{port}'` names it); stop it or give --port"]
    assert time.monotonic() - started < 5  # no model was loaded
