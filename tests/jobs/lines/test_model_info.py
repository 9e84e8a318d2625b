"""The facts a request line is checked against (the model's tokenizer, context and vocabulary) are
built once per process however many threads ask first: a cold start's first burst, where each
built its own tokenizer at once and transformers' import failed some of them."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import worker.model.tokenizer as tokenizer
from jobs.lines.validate import model_info
from tests.support.jobs_env import tiny_settings

THREADS = 16


def test_a_first_burst_on_a_cold_cache_builds_the_tokenizer_once_without_error(tiny_llama_dir, monkeypatch):
    real, builds, inside = tokenizer.load_tokenizer, [], []

    def slow_load(path: str):
        """The real tokenizer, slowly, and failing as an import half done by another thread fails."""
        if inside:
            raise ImportError("cannot import name 'AutoTokenizer' from partially initialized module")
        inside.append(path)
        try:
            builds.append(path)
            time.sleep(0.3)
            return real(path)
        finally:
            inside.remove(path)

    monkeypatch.setattr(tokenizer, "load_tokenizer", slow_load)
    # a served name of its own: facts no test has built yet in this process
    settings = tiny_settings(tiny_llama_dir).model_copy(update={"model_name": f"cold-{uuid.uuid4().hex}"})
    ready = threading.Barrier(THREADS)

    def first_request():
        ready.wait()  # all at once, as the first burst after a start
        return model_info(settings)

    with ThreadPoolExecutor(THREADS) as pool:
        infos = list(pool.map(lambda _: first_request(), range(THREADS)))  # raises the first error, if any
    assert len(builds) == 1
    assert len({id(i.tokenizer) for i in infos}) == 1 and infos[0].name == settings.model_name
    assert model_info(settings).tokenizer is infos[0].tokenizer and len(builds) == 1  # and kept
