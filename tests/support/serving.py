"""Helpers of the HTTP API tests: ``berth serve`` on a thread (uvicorn on 127.0.0.1, a free port),
the unmodified openai client pointed at it, and waiting for a batch."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import openai

from jobs.http.keys import create_key
from jobs.http.server import Server
from jobs.records.db import open_database
from tests.support.jobs_env import tiny_settings

FINAL = ("completed", "failed", "cancelled", "expired")


def embedded_settings(model_dir, tmp_path: Path, **overrides):
    """The embedded defaults in ``tmp_path``: SQLite, the SQLite queue beside it, a local folder store."""
    return tiny_settings(model_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}", **overrides)


@contextmanager
def serving(settings, **kw):
    with Server(settings, port=0, log_level="warning", **kw).running() as server:
        yield server


def key_for(settings, tenant: str) -> str:
    return create_key(open_database(settings.database_url), tenant)


def client(server, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=kw.pop("max_retries", 0),
                         timeout=kw.pop("timeout", 60), **kw)


def wait_for(c: openai.OpenAI, batch_id: str, statuses=FINAL, timeout: float = 120.0, seen: list | None = None):
    """Poll the batch until its status is one of ``statuses``; every status seen goes to ``seen``."""
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != batch.status):
            seen.append(batch.status)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout}s: {batch}"
        time.sleep(0.2)


def upload(c: openai.OpenAI, path: Path, **kw):
    with open(path, "rb") as f:
        return c.files.create(file=f, purpose="batch", **kw)
