"""``berth serve`` driven by the unmodified openai client, without an engine: keys and tenants, bad
uploads and bad batches as OpenAI-shaped errors, pagination, idempotency keys, the File and Batch
objects field for field. (Batches that run are in test_http_embedded.py and test_http_servers.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from click.testing import CliRunner

from jobs.cli import main
from jobs.http.keys import revoke_key
from jobs.records.db import open_database
from tests.support.jobs_env import write_requests
from tests.support.serving import client, embedded_settings, key_for, serving, upload

LIMIT = 64 << 10  # the server's upload limit here
BATCH_FIELDS = {"id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window", "status",
                "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at",
                "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at", "request_counts",
                "metadata", "usage"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("http-api")
    settings = embedded_settings(tiny_llama_dir, tmp, max_file_bytes=LIMIT)
    keys = {"alice": key_for(settings, "alice"), "bob": key_for(settings, "bob")}
    requests = write_requests(tmp / "requests.jsonl", 3)
    with serving(settings, worker=False) as server:
        yield server, keys, requests, tmp


@pytest.fixture
def alice(served):
    server, keys, _, _ = served
    return client(server, keys["alice"])


@pytest.fixture
def bob(served):
    server, keys, _, _ = served
    return client(server, keys["bob"])


def _raw(server, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    request = urllib.request.Request(server.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _batch(c, requests, **kw):
    return c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/chat/completions",
                            completion_window="24h", **kw)


def test_a_request_without_a_valid_key_is_401_in_openais_body(served):
    server, _, _, _ = served
    status, body = _raw(server, "GET", "/v1/batches")
    assert status == 401 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key" and "berth key create" in body["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        client(server, "berth-not-a-key").batches.list()
    status, _ = _raw(server, "GET", "/v1/files", {"Authorization": "Basic YWxpY2U6c2VjcmV0"})
    assert status == 401
    revoked = key_for(server.settings, "zed")
    assert client(server, revoked).batches.list().data == []
    revoke_key(open_database(server.settings.database_url), revoked)
    with pytest.raises(openai.AuthenticationError):
        client(server, revoked).batches.list()


def test_a_tenant_sees_only_its_own_files_and_batches(served, alice, bob):
    _, _, requests, _ = served
    batch = _batch(alice, requests)
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.retrieve(batch.input_file_id), lambda: bob.files.content(batch.input_file_id),
                 lambda: bob.files.delete(batch.input_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert batch.input_file_id not in [f.id for f in bob.files.list()]
    with pytest.raises(openai.BadRequestError, match="names no file of yours"):  # another tenant's file
        bob.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                           completion_window="24h")
    assert alice.batches.retrieve(batch.id).id == batch.id  # still there for its tenant


def test_bad_uploads_get_openai_errors_with_the_right_status(served, alice):
    _, _, requests, tmp = served
    cases = {"not-jsonl.txt": b"this is not JSON\n{\"custom_id\": 1}\n", "empty.jsonl": b"\n\n",
             "array.jsonl": b"[1, 2]\n", "utf16.jsonl": '{"custom_id": "a"}\n'.encode("utf-16"),
             "binary.jsonl": bytes(range(256)) * 4}
    for name, content in cases.items():
        (tmp / name).write_bytes(content)
        with pytest.raises(openai.BadRequestError) as caught:
            upload(alice, tmp / name)
        assert caught.value.status_code == 400 and caught.value.param == "file", name
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'") as caught:
        alice.files.create(file=open(requests, "rb"), purpose="fine-tune")
    assert caught.value.param == "purpose"

    big = tmp / "big.jsonl"
    write_requests(big, LIMIT // 150)
    assert big.stat().st_size > LIMIT
    with pytest.raises(openai.APIStatusError) as caught:
        upload(alice, big)
    assert caught.value.status_code == 413 and caught.value.code == "file_too_large"
    assert "BERTH_MAX_FILE_BYTES" in caught.value.message


def test_bad_batches_get_openai_errors(alice, served):
    _, _, requests, _ = served
    file_id = upload(alice, requests).id
    good = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    bad = [({"input_file_id": "file-000000000000000000000000"}, "input_file_id"),
           ({"input_file_id": "nonsense"}, "input_file_id"),
           ({"endpoint": "/v1/rerank"}, "endpoint"),
           ({"completion_window": "0h"}, None),
           ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
           ({"metadata": {"k" * 65: "v"}}, "metadata"),
           ({"metadata": {"k": "v" * 513}}, "metadata")]
    for change, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            alice.batches.create(**{**good, **change})
        assert caught.value.status_code == 400 and caught.value.param == param, (change, caught.value.body)
    ok = alice.batches.create(**good, metadata={f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: "v"})
    assert len(ok.metadata) == 16
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve("batch_000000000000000000000000")
    with pytest.raises(openai.BadRequestError):
        alice.batches.list(limit=101)


def test_the_batch_and_file_objects_are_openais(served, alice):
    server, keys, requests, _ = served
    batch = _batch(alice, requests, metadata={"team": "search"})
    status, raw = _raw(server, "GET", f"/v1/batches/{batch.id}", {"Authorization": f"Bearer {keys['alice']}"})
    assert status == 200 and set(raw) == BATCH_FIELDS
    assert raw["object"] == "batch" and raw["endpoint"] == "/v1/chat/completions" and raw["metadata"] == {
        "team": "search"}
    assert set(raw["usage"]) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
                                 "total_tokens"}
    assert raw["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert raw["expires_at"] - raw["created_at"] == 24 * 3600
    f = alice.files.retrieve(batch.input_file_id)
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "requests.jsonl", requests.stat().st_size)
    assert alice.files.content(f.id).content == requests.read_bytes()
    assert alice.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f.id)
    assert alice.batches.retrieve(batch.id).input_file_id == f.id  # the batch has its own copy
    assert [m.id for m in alice.models.list()] == ["tiny-llama"]
    assert alice.models.retrieve("tiny-llama").owned_by == "berth"


def test_45_batches_listed_20_at_a_time(served):
    server, _, requests, _ = served
    carol = client(server, key_for(server.settings, "carol"))
    file_id = upload(carol, requests).id
    made = [carol.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h").id
            for _ in range(45)]
    first = carol.batches.list(limit=20)
    assert len(first.data) == 20 and first.has_more and first.data[0].id == made[-1]
    pages = [[b.id for b in page.data] for page in first.iter_pages()]
    assert [len(p) for p in pages] == [20, 20, 5]
    assert [b.id for b in carol.batches.list(limit=20)] == made[::-1]  # auto-pagination, newest first
    status, body = _raw(server, "GET", f"/v1/batches?limit=5&after={made[5]}",
                        {"Authorization": f"Bearer {carol.api_key}"})
    assert status == 200 and [b["id"] for b in body["data"]] == made[4::-1] and body["has_more"] is False
    assert (body["first_id"], body["last_id"]) == (made[4], made[0])


def test_an_idempotency_key_makes_one_file_and_one_batch(served):
    server, _, requests, _ = served
    dave = client(server, key_for(server.settings, "dave"))
    files = [upload(dave, requests, extra_headers={"Idempotency-Key": "upload-1"}) for _ in range(3)]
    assert len({f.id for f in files}) == 1 and len(dave.files.list().data) == 1
    args = {"input_file_id": files[0].id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    made = [dave.batches.create(**args, extra_headers={"Idempotency-Key": "batch-1"}) for _ in range(3)]
    assert len({b.id for b in made}) == 1 and len(dave.batches.list().data) == 1
    with pytest.raises(openai.BadRequestError, match="different request"):
        dave.batches.create(**{**args, "metadata": {"x": "y"}}, extra_headers={"Idempotency-Key": "batch-1"})
    other = dave.batches.create(**args, extra_headers={"Idempotency-Key": "batch-2"})
    assert other.id != made[0].id
    erin = client(server, key_for(server.settings, "erin"))  # keys are per tenant
    assert upload(erin, requests, extra_headers={"Idempotency-Key": "upload-1"}).id != files[0].id


def test_errors_of_routes_and_parameters_are_openai_shaped(served):
    server, keys, _, _ = served
    auth = {"Authorization": f"Bearer {keys['alice']}"}
    for path in ("/v1/nothing", "/v1/batches?limit=0", "/v1/files?order=sideways"):
        status, body = _raw(server, "GET", path, auth)
        assert status in (400, 404) and set(body["error"]) == {"message", "type", "param", "code"}, (path, body)
    status, body = _raw(server, "POST", "/v1/batches", {**auth, "Content-Type": "application/json"}, b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _raw(server, "POST", "/v1/files", {**auth, "Content-Type": "application/json"}, b"{}")
    assert status == 400 and body["error"]["param"] == "file"
    assert _raw(server, "GET", "/openapi.json")[0] == 200


def test_berth_key_create_prints_a_key_the_database_keeps_only_the_hash_of(tmp_path):
    from sqlalchemy import select

    from jobs.records.db import open_database
    from jobs.records.models import ApiKey

    url = f"sqlite:///{tmp_path / 'keys.db'}"
    made = CliRunner().invoke(main, ["key", "create", "--tenant", "team-a", "--database-url", url])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[0]
    assert key.startswith("berth-") and len(key) > 40
    with open_database(url).session() as s:
        stored = s.scalars(select(ApiKey)).one()
    assert key not in (stored.key_hash, stored.prefix) and len(stored.key_hash) == 64
    listed = CliRunner().invoke(main, ["key", "list", "--database-url", url])
    assert stored.prefix in listed.output and "team-a" in listed.output and key not in listed.output
    revoked = CliRunner().invoke(main, ["key", "revoke", key, "--database-url", url])
    assert revoked.exit_code == 0 and "revoked 1 key" in revoked.output


def test_serve_open_refuses_any_address_but_this_machines(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--open", "--host", "0.0.0.0", "--database-url",
                                       f"sqlite:///{tmp_path / 'b.db'}", "--storage-url", f"file://{tmp_path}/s"])
    assert result.exit_code != 0 and "only on this machine" in result.output
