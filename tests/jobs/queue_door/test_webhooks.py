"""Webhooks as a hostile tenant would use them: destinations inside the operator's network refused
when the job is made and again once the name is resolved at send time, a trickling receiver cut
off at one deadline for the whole POST, only due events read and taken from the tenants in turn,
and a signature over a timestamp that a receiver can refuse replays by. SQLite, no broker."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from sqlalchemy import select, update

from jobs import api
from jobs.pipeline.submit import create_failed_job
from jobs.queue_door.contract import SubmitRefused, read_submit, salvage
from jobs.queue_door.destinations import Allowed
from jobs.queue_door.events import due_webhooks
from jobs.queue_door.webhooks import (
    SIGNATURE_HEADER,
    SIGNATURE_V2_HEADER,
    TIMESTAMP_HEADER,
    WebhookSender,
    sign_v2,
    verify,
    verify_v2,
)
from jobs.records.db import open_database
from jobs.records.models import Job, JobEvent
from tests.support.jobs_env import AMQP_URL, TINY_NAME, request_line, tiny_settings
from tests.support.rabbitmq import TricklingReceiver, WebhookReceiver
from worker.config import ConfigError, Settings

MAX = 1 << 20

# Each an address inside (or of) the machine berth runs on, in the spellings a resolver takes
INSIDE = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",  # the cloud's metadata service
    "http://100.100.100.200/latest/meta-data/",  # another cloud's
    "http://[fd00:ec2::254]/latest/meta-data/",  # and its IPv6 one
    "http://10.0.0.1:6379/",  # a database on the private network
    "http://192.168.1.1/admin",
    "http://172.16.0.5:8080/",
    "http://[::1]:5432/",  # loopback
    "http://127.0.0.1:15672/api/users",
    "http://0x7f000001:5432/",  # 127.0.0.1 in hex,
    "http://2130706433/",  # as one number,
    "http://017700000001/",  # in octal,
    "http://127.1/",  # short,
    "http://[::ffff:127.0.0.1]:6379/",  # IPv4-mapped IPv6,
    "http://[::ffff:a9fe:a9fe]/",  # (169.254.169.254 mapped)
    "http://[64:ff9b::a00:1]/",  # NAT64 of 10.0.0.1
    "http://①②⑦.0.0.1/",  # what IDNA makes 127.0.0.1 of
    "http://0.0.0.0:8000/",  # unspecified (connects to loopback)
    "http://[::]:8000/",
    "http://[fe80::1]/",  # link-local
    "http://224.0.0.251:5353/",  # multicast
    "http://240.0.0.1/",  # reserved
    "http://100.64.0.1/",  # carrier-grade NAT: not public
    "http://localhost:8000/",  # loopback by definition (RFC 6761)
    "http://metrics.localhost/",
]
WITH_USERINFO = ["http://user:secret@hooks.example.com/berth", "http://hooks.example.com@10.0.0.1/",
                 "https://token@hooks.example.com/"]


def _settings(tmp_path, **overrides) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'berth.db'}", storage_url=f"file://{tmp_path / 'store'}",
                    **overrides)


def _message(webhook_url: str) -> bytes:
    return json.dumps({"version": 1, "model": TINY_NAME, "requests": [request_line(0)],
                       "webhook_url": webhook_url}).encode()


@pytest.mark.parametrize("url", INSIDE + WITH_USERINFO)
def test_a_webhook_to_an_address_inside_or_with_a_password_is_refused_when_the_job_is_made(url):
    with pytest.raises(SubmitRefused, match="webhook_url") as refused:
        read_submit(_message(url), None, MAX)
    reason = str(refused.value)
    assert ("BERTH_WEBHOOK_ALLOW" in reason) or ("user name or password" in reason and url in WITH_USERINFO)
    assert "webhook_url" not in salvage(_message(url), MAX)  # nor kept on the failed job a refused message makes


def test_a_public_webhook_is_accepted_and_the_allow_list_lets_the_operators_own_through():
    for url in ("https://hooks.example.com/berth?team=a", "http://8.8.8.8:8080/hook", "http://[2606:4700::1111]/"):
        assert read_submit(_message(url), None, MAX).webhook_url == url
    allowed = Allowed.parse("10.1.0.0/16, 127.0.0.1, ::1, hooks.internal")
    for url in ("http://10.1.2.3:9000/", "http://0x7f000001:8000/", "http://[::1]:8000/", "http://[::ffff:127.0.0.1]/",
                "http://hooks.internal/berth"):
        assert read_submit(_message(url), None, MAX, allowed).webhook_url == url
    for url in ("http://10.2.0.1/", "http://169.254.169.254/", "http://127.0.0.2/"):  # only what it names
        with pytest.raises(SubmitRefused, match="BERTH_WEBHOOK_ALLOW"):
            read_submit(_message(url), None, MAX, allowed)
    with pytest.raises(ValueError, match="BERTH_WEBHOOK_ALLOW"):
        Allowed.parse("10.0.0.0/8, not a host!")


def test_the_door_makes_the_refused_message_a_failed_job_with_the_reason_and_no_webhook(tmp_path, tiny_llama_dir):
    from jobs.queue_door.consumer import SubmitConsumer

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", broker_url=AMQP_URL)
    api.allow_broker_user("producer", "mallory", settings)
    door = SubmitConsumer(settings)  # handles a message without a broker; nothing here connects
    job_id = door.handle(_message("http://169.254.169.254/latest/meta-data/"),
                         {"user_id": "producer", "message_id": "m-metadata"})
    with open_database(settings.database_url).session() as s:
        job = s.get(Job, job_id)
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)))
    assert job.status.value == "failed" and "169.254.169.254 is a cloud metadata address" in job.error
    assert job.webhook_url is None and all(e.webhook_due_at is None for e in events)
    with pytest.raises(ConfigError, match="BERTH_WEBHOOK_ALLOW"):
        SubmitConsumer(settings.model_copy(update={"webhook_allow": "nothing/here"}))


def _events(db, job_id: str) -> list[JobEvent]:
    with db.session() as s:
        return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def test_a_name_that_resolves_inside_is_refused_when_the_webhook_is_sent(tmp_path):
    """A job whose webhook was accepted when it was made (before this check, or a name that resolved
    elsewhere then: DNS rebinding) is checked again on the addresses its name resolves to now."""
    settings = _settings(tmp_path)
    db = open_database(settings.database_url)
    receiver = WebhookReceiver()
    try:
        jobs = [create_failed_job(db, "mallory", "refused", webhook_url=url) for url in (
            f"http://localhost:{receiver.port}/hook",  # resolves to 127.0.0.1 (/etc/hosts)
            f"http://0x7f000001:{receiver.port}/hook",  # written before the check at creation
            f"http://user:pw@127.0.0.1:{receiver.port}/hook")]
        assert WebhookSender(settings, db).send_due() == 3
    finally:
        receiver.close()
    assert receiver.got == []  # nothing reached the receiver on loopback
    (localhost,), (odd,), (userinfo,) = (_events(db, j) for j in jobs)
    assert "localhost resolves to 127.0.0.1, a loopback address" in localhost.webhook_error
    assert "127.0.0.1 is a loopback address" in odd.webhook_error
    assert "user name or password" in userinfo.webhook_error
    assert all(e.webhook_due_at is None and e.webhook_attempts == 1 for e in (localhost, odd, userinfo))  # given up


def test_the_allow_list_lets_a_loopback_receiver_have_its_signed_webhook(tmp_path):
    receiver = WebhookReceiver()
    try:
        for i, allow in enumerate(("127.0.0.0/8", "localhost")):  # by network, or by name whatever it resolves to
            (tmp_path / str(i)).mkdir()
            settings = _settings(tmp_path / str(i), webhook_allow=allow)
            db = open_database(settings.database_url)
            create_failed_job(db, "carol", "refused", webhook_url=f"http://localhost:{receiver.port}/hook?x=1")
            assert WebhookSender(settings, db).send_due() == 1
    finally:
        receiver.close()
    assert len(receiver.got) == 2
    headers, body, came = receiver.got[-1]
    secret = api.webhook_secret("carol", settings)
    assert abs(int(headers[TIMESTAMP_HEADER]) - came) < 60
    assert verify_v2(secret, body, headers[TIMESTAMP_HEADER], headers[SIGNATURE_V2_HEADER])
    assert verify(secret, body, headers[SIGNATURE_HEADER])  # v1, as receivers written before check it
    assert json.loads(body)["type"] == "job.failed" and headers["Host"] == f"localhost:{receiver.port}"


def test_the_signature_covers_a_timestamp_so_a_replay_is_refused():
    body, secret, sent = b'{"type":"job.completed","event_id":"evt_7"}', "whsec_1", 1_796_112_000
    signature = sign_v2(secret, sent, body)
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify_v2(secret, body, str(sent), signature, at=sent + 299)  # within the window
    assert not verify_v2(secret, body, str(sent), signature, at=sent + 301)  # played again later
    assert not verify_v2(secret, body, str(sent + 1000), signature, at=sent + 1000)  # a newer stamp: not signed
    assert not verify_v2(secret, body + b" ", str(sent), signature, at=sent)
    assert not verify_v2("whsec_2", body, str(sent), signature, at=sent)
    assert not verify_v2(secret, body, None, signature, at=sent) and not verify_v2(secret, body, "x", signature)
    assert sign_v2(secret, sent, body) != sign_v2(secret, sent + 1, body)  # the time is in the signed bytes


def test_a_trickling_receiver_is_cut_off_at_the_deadline_of_the_whole_post(tmp_path):
    """One byte every 0.5 s: no single read waits long, so a socket timeout never trips; the answer
    would take 30 s. The POST's deadline (2 s here, a knob) ends it all the same."""
    trickle = TricklingReceiver(gap=0.5)
    settings = _settings(tmp_path, webhook_allow="127.0.0.1", webhook_timeout=2.0)
    db = open_database(settings.database_url)
    job_id = create_failed_job(db, "mallory", "refused", webhook_url=f"http://127.0.0.1:{trickle.port}/slow")
    started = time.monotonic()
    try:
        assert WebhookSender(settings, db).send_due() == 1
        took = time.monotonic() - started
    finally:
        trickle.close()
    assert len(TricklingReceiver.ANSWER) * trickle.gap > 25 and took < 15  # generous: cut off, not waited out
    (event,) = _events(db, job_id)
    assert "no answer within 2 s" in event.webhook_error and event.webhook_due_at > time.time()  # tried again later
    assert trickle.connections == 1


def test_only_due_events_are_read_and_the_tenants_take_turns(tmp_path):
    settings = _settings(tmp_path)
    db = open_database(settings.database_url)
    flood = [create_failed_job(db, "flood", "refused", webhook_url=f"http://hooks.example.com/{i}") for i in range(150)]
    with db.session() as s, s.begin():  # 100 of them wait for a retry an hour away
        s.execute(update(JobEvent).where(JobEvent.job_id.in_(flood[:100])).values(webhook_due_at=time.time() + 3600))
    create_failed_job(db, "calm", "refused", webhook_url="http://hooks.example.com/calm")
    with db.session() as s:
        rows = due_webhooks(s, time.time(), per_tenant=4, limit=5)
        assert {e.job_id for e, _, _ in rows} & set(flood[:100]) == set()  # not due: not read
        assert [t.name for _, _, t in rows] == ["flood", "calm", "flood", "flood", "flood"]  # in turn, 4 of one at most
        assert len(due_webhooks(s, time.time(), per_tenant=100, limit=1000)) == 51  # every due one, when asked


def test_tenants_whose_name_servers_hang_hold_only_their_own_slots(tmp_path, monkeypatch):
    """Three tenants' webhook names never resolve: their name servers hang, and a lookup cannot be
    stopped (its thread runs on past the POST's deadline). A fourth tenant's webhook goes out meanwhile."""
    release, real = threading.Event(), socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".slow.test"):
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    settings = _settings(tmp_path, webhook_allow="127.0.0.1")  # the calm receiver is on loopback
    db = open_database(settings.database_url)
    for tenant in ("hang-a", "hang-b", "hang-c"):
        for i in range(6):
            create_failed_job(db, tenant, "refused", webhook_url=f"http://hook{i}.{tenant}.slow.test/")
    receiver = WebhookReceiver()
    create_failed_job(db, "calm", "refused", webhook_url=f"http://localhost:{receiver.port}/calm")
    stop = threading.Event()
    sender = threading.Thread(target=WebhookSender(settings, db).run, args=(stop,), daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 30  # generous for waiting: on time it comes in well under a second
        while not receiver.got:
            assert time.monotonic() < deadline, "calm's webhook waited behind the lookups that hang"
            time.sleep(0.1)
    finally:
        release.set()
        stop.set()
        sender.join(30)
        receiver.close()
    assert receiver.bodies()[0]["tenant"] == "calm" and not sender.is_alive()


def test_the_post_connects_to_the_address_that_was_checked_without_a_second_lookup(tmp_path, monkeypatch):
    """A name that rebinds (its next answer another address) gets one lookup per POST: the address
    checked is the address connected to."""
    answers, real = ["127.0.0.1", "127.0.0.2"], socket.getaddrinfo
    asked = []

    def rebinding(host, port, *args, **kwargs):
        if host == "rebind.test":
            asked.append(host)
            return real(answers[min(len(asked), 2) - 1], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    receiver = WebhookReceiver()  # on 127.0.0.1 only: 127.0.0.2 would refuse the connection
    settings = _settings(tmp_path, webhook_allow="127.0.0.1/32")
    db = open_database(settings.database_url)
    job_id = create_failed_job(db, "carol", "refused", webhook_url=f"http://rebind.test:{receiver.port}/hook")
    try:
        assert WebhookSender(settings, db).send_due() == 1
    finally:
        receiver.close()
    assert asked == ["rebind.test"] and len(receiver.got) == 1 and receiver.got[0][0]["Host"] == (
        f"rebind.test:{receiver.port}")
    assert _events(db, job_id)[0].webhook_sent_at is not None


def test_a_failing_webhooks_log_lines_name_its_host_never_its_path_or_query(tmp_path, monkeypatch, caplog):
    """A webhook URL often is a credential itself (a token in its path or query): a failed attempt
    logs the host it went to, and neither the URL nor a reason quoting it."""
    import jobs.queue_door.webhooks as webhooks

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    secrets = ["hook-path-s3cret", "query-t0ken", "bug-path-s3cret", "bug-query-t0ken", "inside-s3cret", "inside-t0ken"]
    settings = _settings(tmp_path, webhook_allow="127.0.0.1")
    db = open_database(settings.database_url)
    create_failed_job(db, "alice", "refused", webhook_url=f"http://127.0.0.1:{closed}/hook-path-s3cret?sig=query-t0ken")
    create_failed_job(db, "alice", "refused", webhook_url="http://10.0.0.1/inside-s3cret?sig=inside-t0ken")
    sender = WebhookSender(settings, db)
    with caplog.at_level(logging.WARNING, "berth.webhooks"):
        assert sender.send_due() == 2

        async def broken_post(destination, url, *args):  # a bug whose message quotes the URL
            raise RuntimeError(f"cannot post to {url}")

        monkeypatch.setattr(webhooks, "post", broken_post)
        create_failed_job(db, "alice", "refused", webhook_url="https://hooks.example.com/bug-path-s3cret?k=bug-query-t0ken")
        assert sender.send_due() == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "berth.webhooks"]
    assert len(lines) == 4, lines  # the two failed attempts, the bug and its outcome
    text = "\n".join(lines)
    assert f"to 127.0.0.1:{closed}: ConnectionRefusedError" in text
    assert "to 10.0.0.1: webhook_url 10.0.0.1:" in text and "is a private address" in text
    assert "to hooks.example.com: could not be sent (RuntimeError: cannot post to hooks.example.com)" in text
    assert [s for s in secrets if s in text] == []
    (bug,) = (e for e in _events(db, _last_job(db)) if e.webhook_error)
    assert "bug-path-s3cret" in bug.webhook_error  # the tenant's own record keeps its URL's reason whole


def _last_job(db) -> str:
    with db.session() as s:
        return s.scalars(select(Job.id).order_by(Job.created_at.desc())).first()
