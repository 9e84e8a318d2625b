"""The heap a model's build fills is faulted in ahead of it, on a thread, where the last build of the same
model left a hint (worker.engine.heap_prefault): the build's blocks then land on pages already present.
Each case runs in a process of its own (the heap and its thresholds are the process's), and counts the
page faults the kernel reports for the building thread (``ru_minflt``), not time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from worker.config import Settings
from worker.engine import heap_prefault

BLOCK_MIB, BLOCKS = 7, 40  # a build's copies: many blocks under glibc's 32 MiB mapping threshold, 280 MiB

# A stand-in for the model's build: blocks allocated and written, kept, inside ``heap_prefault.build``.
BUILD = r"""
import ctypes, json, os, resource, sys
from worker.config import Settings
from worker.engine import heap_prefault

settings = Settings(model=sys.argv[1])
heap_prefault.start(settings)
libc = heap_prefault._libc()
size, kept = int(sys.argv[2]) * 2**20, []
faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
with heap_prefault.build(settings.model_path(), settings.dtype, settings.weight_dtype):
    for _ in range(int(sys.argv[3])):
        kept.append(libc.malloc(size))
        libc.memset(kept[-1], 1, size)
faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
print(json.dumps({"faults": faults, "pages": int(sys.argv[3]) * size // os.sysconf("SC_PAGE_SIZE")}))
"""


def build(model: Path, cache: Path) -> dict:
    env = {**os.environ, "BERTH_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", BUILD, str(model), str(BLOCK_MIB), str(BLOCKS)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(heap_prefault._libc() is None, reason="glibc's malloc only")
def test_a_second_build_of_a_model_finds_its_heap_faulted_in(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    first = build(model, tmp_path / "cache")
    assert first["faults"] >= 0.9 * first["pages"], first  # no hint yet: every page faulted by the build
    hints = list((tmp_path / "cache" / "heap").iterdir())
    assert len(hints) == 1
    assert json.loads(hints[0].read_text())["heap_bytes"] >= BLOCKS * BLOCK_MIB * 2**20
    second = build(model, tmp_path / "cache")
    assert second["faults"] < 0.1 * second["pages"], second


def test_the_hint_is_per_model_file_dtype_and_weight_dtype(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    files = {heap_prefault.hint_file(str(model), dtype, weights)
             for dtype in ("float32", "bfloat16") for weights in ("auto", "int8")}
    assert len(files) == 4
    before = heap_prefault.hint_file(str(model), "float32", "auto")
    model.write_bytes(b"GGUF, another version")
    assert heap_prefault.hint_file(str(model), "float32", "auto") != before  # a changed file starts afresh


def test_a_damaged_or_missing_hint_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    settings = Settings(model=str(model))
    hint = heap_prefault.hint_file(str(model), settings.dtype, settings.weight_dtype)
    for text in (None, "not json", '{"heap_bytes": "many"}', '{"heap_bytes": -5}'):
        if text is not None:
            hint.parent.mkdir(parents=True, exist_ok=True)
            hint.write_text(text)
        monkeypatch.setattr(heap_prefault, "_started", {})
        heap_prefault.start(settings)
        assert heap_prefault._started == {os.getpid(): None}, text  # no thread, but its build is recorded


def test_nothing_starts_for_a_gpu_or_a_missing_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    heap_prefault.record(heap_prefault.hint_file(str(model), "float32", "auto"), 2**20)
    monkeypatch.setattr(heap_prefault, "_started", {})
    heap_prefault.start(Settings(model=str(model), device="cuda"))
    assert heap_prefault._started == {}  # not even recorded: a GPU's build takes no heap worth a hint
    heap_prefault.start(Settings(model=str(tmp_path / "missing.gguf")))
    assert heap_prefault._started == {os.getpid(): None}  # no hint: no thread (the load will say what is missing)
