"""Shared fixtures: the default model (ours and transformers' reading of the same GGUF file), a tiny
random Llama with grouped-query attention and untied embeddings, and prompts cut from real text."""

from __future__ import annotations

import argparse
import fcntl
import os
import tempfile
import time
from pathlib import Path

# torch's OpenMP threads spin up to 300,000 rounds waiting for work (libgomp's default): on a machine
# whose cores are busy with other work, each engine step's many small parallel regions then wait for
# a thread that spins on a core someone else holds. Beside two busy loops on 2 cores the default
# model's exactness test took 335 s with the default, 91 s with 10,000 rounds, 100 s with
# OMP_WAIT_POLICY=PASSIVE; 41 s, 44 s and 52 s with the cores free. Read by libgomp when torch loads
# it, so before the first torch import; the engine workers the tests start inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# rabbitmqctl boots an Erlang VM whose schedulers, one a core, spin waiting for work: beside two busy loops
# on 2 cores a call took 3-9 s, 1.0-1.2 s on one scheduler that does not spin (0.3 s either way when idle).
os.environ.setdefault("RABBITMQ_CTL_ERL_ARGS", "+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none")

import pytest
import torch

from tests.support.models import save_tiny_model
from tests.support.services_lock import SERVICES_LOCK, needs_services

# Fixtures shared by test folders: the jobs tests' databases and queue prefixes, an S3 server, RabbitMQ
# users, a tiny Qwen3 that calls tools, the Ctrl-C tests' uninterrupted run; and the check that no test
# leaves a ledger process running.
pytest_plugins = ("tests.support.jobs_env", "tests.support.s3_server", "tests.support.rabbitmq", "tests.support.qwen",
                  "tests.support.leaks", "tests.support.interrupted_runs")

os.environ.setdefault("HF_HUB_OFFLINE", "1")



def pytest_collection_modifyitems(items):
    """The modules with a test marked ``slow`` first (in their order, each whole, so that a module's fixtures
    are made once): the suite's processes take tests as they finish them, and a minute-long test taken last
    left one process running it alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


LOCK_WAIT = "services_lock_wait"  # a test's user property: seconds it waited for the services lock


@pytest.fixture(autouse=True)
def _services_lock(request):
    """Set up before the test's other fixtures (autouse first) and released after their teardown, so that a
    database is neither created nor dropped while PostgreSQL is down for an exclusive test; none for the tests
    that reach no shared service (``tests.support.services_lock``). A wait of over a second is kept with the
    test's reports, for the summary."""
    exclusive = request.node.get_closest_marker("exclusive")
    callspec = getattr(request.node, "callspec", None)
    if not exclusive and not needs_services(request.node.fixturenames, request.node.path,
                                            callspec.params if callspec else None):
        yield
        return
    with open(SERVICES_LOCK, "a") as lock:
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if (waited := time.monotonic() - started) > 1.0:
            request.node.user_properties.append((LOCK_WAIT, waited))
        yield


def pytest_terminal_summary(terminalreporter):
    """The seconds tests waited for the services lock (behind an ``exclusive`` test), the longest waits named."""
    waits = sorted(((value, report.nodeid) for reports in terminalreporter.stats.values() for report in reports
                    if getattr(report, "when", None) == "setup"
                    for name, value in getattr(report, "user_properties", ()) if name == LOCK_WAIT), reverse=True)
    if waits:
        total = sum(waited for waited, _ in waits)
        terminalreporter.write_sep("=", f"{len(waits)} tests waited {total:.0f} s in all for the services lock")
        for waited, nodeid in waits[:5]:
            terminalreporter.write_line(f"{waited:6.1f}s {nodeid}")


@pytest.fixture(scope="session")
def smol_path() -> str:
    from worker.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_loaded(smol_path):
    from worker.model.loader import load_model

    return load_model(smol_path, torch.float32)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' own reading of the GGUF file: an independent check of our loader. Its reading takes
    16 s of CPU (gguf-py's field parsing), so the weights and config it read are kept, once per GGUF file
    and transformers version, for the suite's other processes and runs (transformers will not save a model
    it read from GGUF: its state dict and config are kept instead)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    p = Path(smol_path)
    stat = p.stat()
    folder = Path(tempfile.gettempdir()) / "berth-tests-hf"
    folder.mkdir(exist_ok=True)
    kept = folder / f"{p.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}.pt"
    with open(f"{kept}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process reads the GGUF file, the others wait and load what it kept
        if not kept.exists():
            hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
            config = hf.config.to_dict()
            config.pop("quantization_config", None)
            torch.save({"config": config, "state": hf.state_dict()}, f"{kept}.partial")
            os.replace(f"{kept}.partial", kept)
    saved = torch.load(kept, weights_only=True)
    with no_init_weights():  # its weights are all in the state dict: no random draw first (3.5 s)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**saved["config"]), dtype=torch.float32)
    hf.load_state_dict(saved["state"])
    return hf.eval()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    """The default model's tokenizer, read without its weights."""
    from worker.model.tokenizer import load_tokenizer

    return load_tokenizer(smol_path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer Llama, GQA 4:2, untied embeddings, saved as a safetensors folder with the
    default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_tiny_model(LlamaConfig, LlamaForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("tiny-llama"),
                           tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from worker.model.loader import load_model

    return load_model(str(tiny_llama_dir), torch.float32)


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def text_ids(smol_tokenizer) -> list[int]:
    """Token ids of real English prose and code: the standard library's argparse module."""
    text = Path(argparse.__file__).read_text()
    return smol_tokenizer(text, add_special_tokens=False)["input_ids"]
