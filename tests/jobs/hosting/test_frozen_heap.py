"""The heap as a run starts is frozen for the run (``worker.frozen_heap``): the collector's full walks,
which stopped the loop for 200 ms at a GPU's pace, then skip the model's and the libraries' objects.
Checked on both hosts of an engine (``berth generate``'s file loop and the engine worker, ``berth run``'s
and ``berth worker``'s), and that the run gives everything back: what it froze is collectable after. A
command's start-up (``start_up``) runs without the collector, which its first run turns back on."""

from __future__ import annotations

import gc
import weakref

import pytest

from jobs import api
from jobs.hosting.generate import generate_file
from tests.support.jobs_env import embedded_settings, write_requests
from worker.frozen_heap import start_up


class _Cycle:
    def __init__(self):
        self.me = self


def _garbage_cycle() -> weakref.ref:
    """A cycle no one holds: only the collector frees it."""
    return weakref.ref(_Cycle())


@pytest.fixture
def frozen_during_steps(tiny_engine):
    """The collector at every step of ``tiny_engine``: its permanent generation's size (or 0), and whether it is on."""
    seen = []
    step = tiny_engine.step

    def watched():
        seen.append((gc.get_freeze_count(), gc.isenabled()))
        return step()

    tiny_engine.step = watched
    yield seen
    del tiny_engine.step


def _check(seen: list[tuple[int, bool]], before: weakref.ref) -> None:
    assert seen and min(frozen for frozen, _ in seen) > 1000, "the start-up heap was not frozen as the engine stepped"
    assert all(on for _, on in seen), "the run stepped without the collector"
    assert gc.get_freeze_count() == 0, "the run left objects frozen: they would never be collected"
    gc.collect()
    assert before() is None, "garbage made before the run was not given back to the collector after it"


def test_berth_generate_freezes_the_start_up_heap_for_its_run(tmp_path, tiny_engine, frozen_during_steps):
    before = _garbage_cycle()
    generate_file(write_requests(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl", engine=tiny_engine,
                  progress=False)
    _check(frozen_during_steps, before)


def test_the_engine_worker_freezes_the_start_up_heap_for_its_run(tmp_path, tiny_llama_dir, tiny_engine,
                                                                  frozen_during_steps):
    before = _garbage_cycle()
    job, files = api.run(write_requests(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl",
                         embedded_settings(tiny_llama_dir, tmp_path), engine=tiny_engine)
    assert job.completed == 3
    _check(frozen_during_steps, before)


def test_a_start_up_runs_without_the_collector_and_its_run_with_it(tmp_path, tiny_engine, frozen_during_steps):
    try:
        with start_up():
            assert not gc.isenabled()
            made = [_garbage_cycle() for _ in range(2000)]  # past the collector's thresholds: it would have run
            assert all(ref() is not None for ref in made), "the collector ran during start-up"
            generate_file(write_requests(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl", engine=tiny_engine,
                          progress=False)
            assert gc.isenabled(), "the run's end left the collector off"
    finally:
        gc.enable()  # whatever happened, not left off for the tests after
    _check(frozen_during_steps, made[0])


def test_a_command_that_ends_before_its_run_leaves_the_collector_on(tmp_path):
    from click.testing import CliRunner

    from jobs.cli import main

    try:
        for command in ("generate", "run"):  # an output folder that does not exist: said before the model loads
            result = CliRunner().invoke(main, [command, str(write_requests(tmp_path / "in.jsonl", 1)),
                                               "-o", str(tmp_path / "nowhere" / "out.jsonl")])
            assert result.exit_code == 1 and "does not exist" in result.output, result.output
            assert gc.isenabled(), f"berth {command} left the collector off"
    finally:
        gc.enable()
