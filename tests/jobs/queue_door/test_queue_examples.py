"""The producer examples of docs/queue.md, run as they are: examples/queue/submit.js (Node, amqplib)
and examples/queue/submit.py (pika) each submit a job and print its events until it ends; the curl
line (examples/queue/submit.sh) is checked against a stand-in for RabbitMQ's management API, whose
plugin is not enabled on the test machines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from jobs import api
from tests.support.jobs_env import TINY_NAME, work_until_over, write_requests
from tests.support.paths import ROOT
from tests.support.rabbitmq import door_settings, job_of, start_door

EXAMPLES = ROOT / "examples" / "queue"


def _command(kind: str) -> list[str]:
    if kind == "node":
        if shutil.which("node") is None:
            pytest.skip("node is not installed")
        if not (EXAMPLES / "node_modules" / "amqplib").is_dir():
            pytest.skip("amqplib is not installed: npm install --prefix examples/queue")
        return ["node", str(EXAMPLES / "submit.js")]
    return [sys.executable, str(EXAMPLES / "submit.py")]


@pytest.mark.parametrize("kind", ["node", "python"])
def test_the_documented_producer_submits_a_job_and_follows_it_to_the_end(
        kind, tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    command = _command(kind)
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    api.allow_broker_user("guest", "alice", settings)
    requests = write_requests(tmp_path / "requests.jsonl", 3)
    message_id = f"example-{kind}-1"
    env = {**os.environ, "AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/" + ("" if kind == "node" else "%2F"),
           "BERTH_QUEUE_PREFIX": queue_prefix, "MESSAGE_ID": message_id, "BERTH_TENANT": "alice"}
    job, events = _produce(settings, tiny_engine, command, requests, env, message_id)
    assert [e["type"] for e in events] == ["job.validating", "job.in_progress", "job.finalizing", "job.completed"]
    assert events[-1]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert events[-1]["job_id"] == job.id and job.metadata == {"submitted_by": Path(command[-1]).name}


def test_the_python_producer_needs_no_more_than_a_tenant_users_permissions(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix, broker_users):
    """examples/queue/submit.py connected as a user with only the documented permissions of a tenant's
    (docs/queue.md): it submits, and follows its job's events to the end."""
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    user, url = broker_users("team.a")  # a dot in the name: its routing keys' word is team%2Ea
    api.allow_broker_user(user, "team.a", settings)
    requests = write_requests(tmp_path / "requests.jsonl", 2)
    env = {**os.environ, "AMQP_URL": url, "BERTH_QUEUE_PREFIX": queue_prefix, "MESSAGE_ID": "example-tenant-1",
           "BERTH_TENANT": "team.a"}
    job, events = _produce(settings, tiny_engine, _command("python"), requests, env, "example-tenant-1")
    assert [e["type"] for e in events] == ["job.validating", "job.in_progress", "job.finalizing", "job.completed"]
    assert {e["tenant"] for e in events} == {"team.a"} and events[-1]["job_id"] == job.id


def _produce(settings, engine, command: list[str], requests: Path, env: dict, message_id: str):
    """Run the producer ``command`` beside the door until its job is over: the job and the events the
    producer printed."""
    door = start_door(settings)
    producer = subprocess.Popen([*command, str(requests), "--model", TINY_NAME], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        job = work_until_over(settings, engine, job_of(settings, message_id))
        out, err = producer.communicate(timeout=30)
    finally:
        if producer.poll() is None:
            producer.kill()
        door.stop()
    assert producer.returncode == 0, err
    return job, [json.loads(line) for line in out.splitlines()]


def test_the_curl_line_posts_what_the_management_api_publishes(tmp_path):
    """What examples/queue/submit.sh sends to RabbitMQ's management API (POST
    /api/exchanges/%2F/<prefix>.submit/publish), caught by a stand-in for it."""
    if shutil.which("jq") is None or shutil.which("curl") is None:
        pytest.skip("submit.sh needs jq and curl")
    got = []

    class Management(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append((self.path, self.headers["Authorization"], json.loads(self.rfile.read(
                int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"routed":true}')

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Management)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    message = tmp_path / "message.json"
    message.write_text(json.dumps({"version": 1, "model": TINY_NAME, "input_url": "s3://inbox/a.jsonl"}))
    env = {**os.environ, "RABBIT_URL": f"http://127.0.0.1:{server.server_port}", "RABBIT_USER": "alice",
           "RABBIT_PASS": "secret", "BERTH_QUEUE_PREFIX": "berth"}
    try:
        out = subprocess.run(["sh", str(EXAMPLES / "submit.sh"), str(message), "order-42"], env=env,
                             capture_output=True, text=True, timeout=30, check=True).stdout
    finally:
        server.shutdown()
        server.server_close()
    assert out.strip() == '{"routed":true}'
    [(path, auth, body)] = got
    assert path == "/api/exchanges/%2F/berth.submit/publish" and auth.startswith("Basic ")
    assert body == {"routing_key": "berth.jobs", "payload": message.read_text(), "payload_encoding": "string",
                    "properties": {"delivery_mode": 2, "content_type": "application/json", "message_id": "order-42",
                                   "user_id": "alice"}}
