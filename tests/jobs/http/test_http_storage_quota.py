"""The storage quota counts everything a tenant stores (issue 34, finding 3): batches' copies of their
inputs and their outputs, whatever door made the job, not only what ``GET /v1/files`` lists; and a
job's copy of its input expires with the job, at the defaults a user gets."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from jobs.records.db import open_database
from jobs.records.file_removal import expire_files
from jobs.records.models import Job
from jobs.records.status import get_job
from storage import open_store
from tests.support.jobs_env import write_requests
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for
from worker.config import Settings


def _stored_bytes(settings) -> int:
    root = Path(settings.storage_url.removeprefix("file://"))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _batch(c, file_id: str) -> str:
    return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id


def test_batches_copies_of_an_upload_count_in_the_quota_after_it_is_deleted(tmp_path, tiny_llama_dir):
    """The finding, scaled down: a quota of 2.5 uploads; the upload turned into batches (cancelled) and
    deleted. Before, every batch was accepted, the store held a copy per batch beyond the quota, and a
    new upload was accepted; now a batch that does not fit is refused (413 storage_quota_exceeded),
    and the store never holds more than the quota."""
    requests = write_requests(tmp_path / "r.jsonl", 40)
    size = requests.stat().st_size
    quota = int(2.5 * size)
    settings = embedded_settings(tiny_llama_dir, tmp_path, tenant_max_storage_bytes=quota)
    with serving(settings, worker=False) as server:
        c = client(server, key_for(settings, "alice"))
        file_id = upload(c, requests).id
        made, refused = [], []
        for _ in range(5):
            try:
                made.append(_batch(c, file_id))
            except openai.APIStatusError as exc:
                refused.append(exc)
        for batch_id in made:
            c.batches.cancel(batch_id)
            wait_for(c, batch_id)
        c.files.delete(file_id)
        assert len(made) == 1 and len(refused) == 4, (made, refused)
        assert refused[0].status_code == 413 and refused[0].code == "storage_quota_exceeded"
        assert "batches' copies of their inputs" in refused[0].message
        assert _stored_bytes(settings) <= quota
        with pytest.raises(openai.APIStatusError) as caught:  # the batch's copy and its errors file hold the room
            upload(c, requests)
        assert caught.value.code == "storage_quota_exceeded"


def test_a_jobs_copy_of_its_input_expires_with_the_job_at_the_defaults(tmp_path, tiny_llama_dir):
    """Before, a job's copy of its input stayed in the store for ever; now it is deleted (and no longer
    counted) ``job_input_retention_seconds`` after the job ends, 30 days by default, or with its
    outputs when their output_expires_after is shorter."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    assert settings.job_input_retention_seconds == Settings.model_fields["job_input_retention_seconds"].default
    requests = write_requests(tmp_path / "r.jsonl", 3)
    with serving(settings, worker=False) as server:
        c = client(server, key_for(settings, "alice"))
        file_id = upload(c, requests).id
        kept = _batch(c, file_id)
        short = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}}).id
        for batch_id in (kept, short):
            c.batches.cancel(batch_id)
            wait_for(c, batch_id)
        db = open_database(settings.database_url)
        assert get_job(db, kept).cancelled_at is not None
        with db.session() as s:
            sizes = {j.id: j.input_bytes for j in s.query(Job)}
        assert sizes == {kept: requests.stat().st_size, short: requests.stat().st_size}
        store = open_store(settings.storage_url)
        ended = get_job(db, kept).cancelled_at
        expire_files(db, store, at=ended + 3601, input_retention=settings.job_input_retention_seconds)
        assert [i.key for i in store.list(f"jobs/{short}/") if i.key.endswith("input.jsonl")] == []
        with db.session() as s:
            assert {j.id: j.input_bytes for j in s.query(Job)} == {kept: requests.stat().st_size, short: 0}
        expire_files(db, store, at=ended + settings.job_input_retention_seconds + 1,
                     input_retention=settings.job_input_retention_seconds)
        with db.session() as s:
            assert {j.id: j.input_bytes for j in s.query(Job)} == {kept: 0, short: 0}
        assert [i.key for i in store.list(f"jobs/{kept}/") if i.key.endswith("input.jsonl")] == []
