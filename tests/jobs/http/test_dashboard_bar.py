"""The dashboard's bar tells failed lines apart (it was all blue when 8 of 11 lines failed), and the
sign-in field hints at berth's keys, not OpenAI's."""

from __future__ import annotations

import http.client
import re
import time

from tests.support.jobs_env import write_requests
from tests.support.serving import client, embedded_settings, key_for, serving, upload


def _get(server, path: str, key: str | None = None) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    body = conn.getresponse().read().decode()
    conn.close()
    return body


def test_failed_lines_are_red_on_the_bar_and_the_key_hint_is_berths(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    requests = write_requests(tmp_path / "r.jsonl", 1)
    requests.write_text(requests.read_text() + "not json\n{\n[]\n")  # 1 good line, 3 that fail
    with serving(settings, worker=False) as server:  # no worker: the good line waits
        c = client(server, key)
        batch = c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/completions",
                                 completion_window="24h")
        for _ in range(100):
            if c.batches.retrieve(batch.id).request_counts.failed == 3:
                break
            time.sleep(0.1)
        for page in ("/", f"/dashboard/jobs/{batch.id}"):
            html = _get(server, page, key)
            ok, bad = (float(re.search(rf'<rect class="{name}"[^>]* width="([0-9.]+)"', html).group(1))
                       for name in ("ok", "bad"))
            assert (ok, bad) == (0.0, 75.0), page
            assert 'aria-label="3 of 4 done, 3 failed"' in html
        assert 'placeholder="berth-..."' in _get(server, "/dashboard/login")


def _post(server, path: str, key: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, headers={"Authorization": f"Bearer {key}", "Sec-Fetch-Site": "same-origin",
                                        "Content-Length": "0"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, response.getheader("Location") or ""


def test_a_jobs_page_cancels_retries_and_downloads_its_files_for_its_tenant_alone(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    alice, bob = key_for(settings, "alice"), key_for(settings, "bob")
    requests = write_requests(tmp_path / "r.jsonl", 2)
    requests.write_text(requests.read_text() + "not json\n")
    with serving(settings, worker=False) as server:  # no worker: the good lines wait until cancelled
        c = client(server, alice)
        batch = c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/completions",
                                 completion_window="24h", metadata={"team": "search"})
        for _ in range(100):  # its lines checked (the bad one failed) before it is cancelled: ingest runs apart
            if c.batches.retrieve(batch.id).status != "validating":
                break
            time.sleep(0.1)
        html = _get(server, f"/dashboard/jobs/{batch.id}", alice)
        assert 'action="/dashboard/jobs/' + batch.id + '/cancel"' in html and "<code>team</code> = search" in html
        assert "created " in html
        assert _post(server, f"/dashboard/jobs/{batch.id}/cancel", bob)[0] == 404  # not bob's
        status, location = _post(server, f"/dashboard/jobs/{batch.id}/cancel", alice)
        assert (status, location) == (303, f"/dashboard/jobs/{batch.id}")
        for _ in range(100):
            if (done := c.batches.retrieve(batch.id)).status == "cancelled":
                break
            time.sleep(0.1)
        assert done.status == "cancelled" and done.error_file_id
        errors = _get(server, f"/dashboard/jobs/{batch.id}/files/errors", alice)
        assert len(errors.splitlines()) == 3 and "not valid JSON" in errors
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", f"/dashboard/jobs/{batch.id}/files/errors", headers={"Authorization": f"Bearer {bob}"})
        assert conn.getresponse().status == 404  # bob learns nothing of alice's job
        conn.close()
        status, location = _post(server, f"/dashboard/jobs/{batch.id}/retry", alice)
        assert status == 303 and location.startswith("/dashboard/jobs/batch_") and batch.id not in location
        for _ in range(100):  # ingested in the background
            if (retried := c.batches.retrieve(location.rsplit("/", 1)[1])).request_counts.total:
                break
            time.sleep(0.1)
        assert retried.request_counts.total == 2  # the two cancelled lines; the bad one would fail again
