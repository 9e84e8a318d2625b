"""A tenant's interactive limits on ``berth serve`` (issue 34, finding 4): its chat and completions
requests running at once, and their tokens in any 60 s. Past either, a 429 in OpenAI's body with
Retry-After while other tenants are served; a request's place comes back when it ends or its caller
leaves, its tokens are corrected to those it used; a tenant's own limits beat the defaults; ``berth
tenant`` sets and shows them, ``berth status`` and the dashboard show them, the metrics count them.

The requests run on ``HeldChannel`` (no engine: each runs until the test ends it) and the window's
time on a clock the test moves, so nothing here waits for a minute or on an engine's pace."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import openai
import pytest

from jobs.records.budgets import set_interactive_limits
from jobs.records.db import open_database
from tests.support.held_channel import FakeClock, HeldChannel, serving_app, wait_until
from tests.support.jobs_env import TINY_NAME
from tests.support.serving import embedded_settings, key_for

COMPLETIONS = "/v1/completions"
PROMPT = [1, 2, 3, 4]  # token ids: the prompt holds exactly 4 tokens


def body(max_tokens: int = 8, stream: bool = False) -> dict:
    return {"model": TINY_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


def post(url: str, key: str, payload: dict, timeout: float = 30) -> tuple[int, dict, dict | None]:
    """(status, headers, JSON body) of one request answered whole."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", COMPLETIONS, json.dumps(payload), {"Authorization": f"Bearer {key}",
                                                                "Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, dict(response.getheaders()), json.loads(data) if data else None
    finally:
        conn.close()


class Caller:
    """One request on a thread of its own, its answer kept once it comes."""

    def __init__(self, url: str, key: str, payload: dict):
        self.answer = None
        self._thread = threading.Thread(target=lambda: setattr(self, "answer", post(url, key, payload)), daemon=True)
        self._thread.start()

    def result(self) -> tuple:
        self._thread.join(timeout=30)
        assert self.answer is not None, "no answer"
        return self.answer


class Stream:
    """A streamed request on a raw socket: its first chunk read, then ended by the server or left."""

    def __init__(self, url: str, key: str, max_tokens: int = 8):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        data = json.dumps(body(max_tokens, stream=True)).encode()
        self.sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        self.received = b""
        while b"data: " not in self.received:
            self.received += self.sock.recv(65536)
        assert self.received.startswith(b"HTTP/1.1 200"), self.received

    def read_to_end(self) -> bytes:
        while not self.received.endswith(b"0\r\n\r\n"):
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.received += chunk
        self.sock.close()
        return self.received

    def leave(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def assert_rate_limited(answer: tuple, *words: str) -> int:
    """A 429 in OpenAI's body (the same shape as berth's other 429s) with Retry-After; its seconds."""
    status, headers, payload = answer
    assert status == 429, answer
    error = payload["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "rate_limit_exceeded", None), error
    for word in words:
        assert word in error["message"], error
    return int(headers["retry-after"])


@pytest.fixture
def held(tmp_path, tiny_llama_dir):
    """(settings, channel, clock) for a server with live requests 2 and 1,000 tokens a minute by default."""
    settings = embedded_settings(tiny_llama_dir, tmp_path, http_tenant_live_requests=2,
                                 http_tenant_tokens_per_minute=1000)
    return settings, HeldChannel(), FakeClock()


def test_a_tenant_at_its_live_limit_gets_429_while_another_is_served(held):
    """Tenant A holds its 2 requests: its third is a 429 at once, with Retry-After, naming the limit and
    the setting (the openai client raises RateLimitError); tenant B's request is served meanwhile. When
    one of A's ends, A is served again."""
    settings, channel, clock = held
    with serving_app(settings, channel, clock) as (url, app):
        a, b = key_for(settings, "alice"), key_for(settings, "bob")
        first, second = Caller(url, a, body()), Caller(url, a, body())
        wait_until(lambda: len(channel.ids()) == 2, "A's two requests running")
        assert assert_rate_limited(post(url, a, body()), "BERTH_HTTP_TENANT_LIVE_REQUESTS", "2 interactive") == 1
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=url + "/v1", api_key=a, max_retries=0).completions.create(**body())

        other = Caller(url, b, body())
        wait_until(lambda: len(channel.ids()) == 3, "B's request running beside A's two")
        channel.finish(channel.ids()[-1], 2)
        status, _, answer = other.result()
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer

        channel.finish(channel.ids()[0])
        ended = wait_until(lambda: first.answer or second.answer, "one of A's answered")
        assert ended[0] == 200, ended
        again = Caller(url, a, body())
        wait_until(lambda: len(channel.ids()) == 2, "A served again once one of its requests ended")
        for request_id in channel.ids():
            channel.finish(request_id)
        assert again.result()[0] == first.result()[0] == second.result()[0] == 200
        assert app.state.limiter.refusals() == {("alice", "live_requests"): 2}
        wait_until(lambda: app.state.limiter.usage("alice")[0] == 0, "A's places back")


def test_a_stream_gives_its_place_back_when_it_ends_and_when_its_caller_leaves(held, tiny_llama_dir, tmp_path):
    """Live limit 1: a running stream holds the place (one more is a 429); once it ends, the place is back;
    a stream whose caller hangs up mid-answer gives it back too, and its request is aborted."""
    settings, channel, clock = held
    set_interactive_limits(open_database(settings.database_url), "alice", live_requests=1)
    with serving_app(settings, channel, clock) as (url, app):
        a = key_for(settings, "alice")
        stream = Stream(url, a)
        assert_rate_limited(post(url, a, body()), "set by `berth tenant NAME --live-requests`")
        channel.finish(channel.ids()[0], 3)
        assert stream.read_to_end().count(b"data: [DONE]") == 1
        wait_until(lambda: app.state.limiter.usage("alice")[0] == 0, "the ended stream's place back")

        left = Stream(url, a)
        [request_id] = channel.ids()
        assert post(url, a, body())[0] == 429
        left.leave()
        wait_until(lambda: app.state.limiter.usage("alice")[0] == 0, "the place of the stream whose caller left")
        assert channel.aborted == [request_id]
        Stream(url, a).leave()  # served again
        wait_until(lambda: len(channel.aborted) == 2, "the second stream left too")


def test_tokens_per_minute_refuse_and_recover_as_the_window_moves(held):
    """1,000 tokens a minute by default; here alice's own 100. Each request holds its 4 prompt tokens and
    max_tokens from its admission, corrected to what it used when it ends: the first (40 asked, 10 used)
    holds 14 after its end, so a third request that fits only thanks to that correction is served, and a
    fourth is a 429 whose Retry-After is when the first leaves the window (60 s after it came). Once the
    clock passes that, the fourth is served. One asking for more than the limit alone is a 400 naming
    max_tokens (a retry can never pass). Tenant bob, on the default, is served throughout."""
    settings, channel, clock = held
    set_interactive_limits(open_database(settings.database_url), "alice", live_requests=0, tokens_per_minute=100)
    with serving_app(settings, channel, clock) as (url, app):
        a, b = key_for(settings, "alice"), key_for(settings, "bob")
        limiter = app.state.limiter
        first = Caller(url, a, body(40))
        wait_until(lambda: len(channel.ids()) == 1, "the first running")
        assert limiter.usage("alice") == (1, 44)
        channel.finish(channel.ids()[0], 9)  # 10 tokens made
        assert first.result()[0] == 200
        wait_until(lambda: limiter.usage("alice") == (0, 14), "the first corrected to what it used")

        clock.advance(10)
        second = Caller(url, a, body(40))  # 14 + 44 = 58
        wait_until(lambda: len(channel.ids()) == 1, "the second running")
        clock.advance(10)
        third = Caller(url, a, body(38))  # 58 + 42 = 100: fits only because the first holds 14, not 44
        wait_until(lambda: len(channel.ids()) == 2, "the third running")
        refused = post(url, a, body(1))  # 100 + 5
        assert assert_rate_limited(refused, "tokens per min (TPM): Limit 100, Used 100, Requested 5") == 40
        other = Caller(url, b, body(40))  # bob's window is his own
        wait_until(lambda: len(channel.ids()) == 3, "bob's request running")
        clock.advance(40.5)  # the first's 14 left the window: 86 held
        fourth = Caller(url, a, body(1))
        wait_until(lambda: len(channel.ids()) == 4, "the fourth served once the window moved")
        assert limiter.usage("alice") == (3, 91)
        status, _, too_big = post(url, a, body(200))
        assert status == 400 and too_big["error"]["param"] == "max_tokens", too_big
        assert too_big["error"]["code"] == "tokens_per_minute_exceeded", too_big
        for request_id in channel.ids():
            channel.finish(request_id)
        assert second.result()[0] == third.result()[0] == fourth.result()[0] == other.result()[0] == 200
        assert limiter.refusals() == {("alice", "tokens_per_minute"): 1}


def test_a_tenants_own_limits_beat_the_defaults_and_default_again(held):
    """Default 2 live requests; alice's own 3, then 0 (no limit), then the default again, each applied
    by a running server once its cached limits expire (5 s on the server's clock)."""
    settings, channel, clock = held
    db = open_database(settings.database_url)
    set_interactive_limits(db, "alice", live_requests=3)
    with serving_app(settings, channel, clock) as (url, app):
        a, b = key_for(settings, "alice"), key_for(settings, "bob")
        callers = [Caller(url, a, body()) for _ in range(3)] + [Caller(url, b, body()) for _ in range(2)]
        wait_until(lambda: len(channel.ids()) == 5, "alice's 3 and bob's 2 running")
        assert_rate_limited(post(url, a, body()), "3 interactive")
        assert_rate_limited(post(url, b, body()), "2 interactive", "BERTH_HTTP_TENANT_LIVE_REQUESTS")

        set_interactive_limits(db, "alice", live_requests=0)
        assert post(url, a, body())[0] == 429  # still the cached 3
        clock.advance(6)
        callers += [Caller(url, a, body()) for _ in range(3)]
        wait_until(lambda: len(channel.ids()) == 8, "alice unlimited")

        set_interactive_limits(db, "alice", live_requests=None)
        clock.advance(6)
        assert_rate_limited(post(url, a, body()), "6 interactive", "BERTH_HTTP_TENANT_LIVE_REQUESTS")
        for request_id in channel.ids():
            channel.finish(request_id)
        assert all(c.result()[0] == 200 for c in callers)


def test_the_dashboard_and_the_metrics_show_a_tenants_limits_and_use(held):
    """A tenant's dashboard data holds its own limits and use, not another's; the operator's page (an
    open server) every tenant's; the metrics a gauge of live requests by tenant and 429s by reason."""
    from prometheus_client import CollectorRegistry, generate_latest

    from worker.metrics import InteractiveLimitMetrics

    settings, channel, clock = held
    with serving_app(settings, channel, clock) as (url, app):
        a, b = key_for(settings, "alice"), key_for(settings, "bob")
        callers = [Caller(url, a, body()), Caller(url, a, body()), Caller(url, b, body(20))]
        wait_until(lambda: len(channel.ids()) == 3, "three running")
        post(url, a, body())  # a 429

        def data(key: str) -> dict:
            host, port = url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("GET", "/dashboard/data.json", headers={"Authorization": f"Bearer {key}"})
            return json.loads(conn.getresponse().read())

        assert data(a)["interactive"] == [{"tenant": "alice", "live": 2, "live_limit": 2, "tokens": 24,
                                           "tokens_per_minute": 1000}]
        assert [row["tenant"] for row in data(b)["interactive"]] == ["bob"]

        registry = CollectorRegistry()
        limiter = app.state.limiter
        registry.register(InteractiveLimitMetrics(limiter.tenants, limiter.refusals))
        page = generate_latest(registry).decode()
        assert 'berth_tenant_interactive_live_requests{tenant="alice"} 2.0' in page
        assert 'berth_tenant_interactive_tokens_last_minute{tenant="bob"} 24.0' in page
        assert 'berth_interactive_rate_limited_total{reason="live_requests",tenant="alice"} 1.0' in page
        for request_id in channel.ids():
            channel.finish(request_id)
        assert all(c.result()[0] == 200 for c in callers)


def test_berth_tenant_sets_and_shows_the_interactive_limits(tmp_path, tiny_llama_dir, monkeypatch):
    """`berth tenant NAME --live-requests N --tokens-per-minute N` sets them and shows them, 'default'
    gives the settings' back, a bad count is refused naming the flag; `berth status` shows them."""
    from click.testing import CliRunner

    from jobs.cli import main
    from tests.support.jobs_env import tiny_env, write_requests

    settings = embedded_settings(tiny_llama_dir, tmp_path)
    for name, value in tiny_env(settings).items():
        if value != "None":
            monkeypatch.setenv(name, value)
    runner = CliRunner()
    shown = runner.invoke(main, ["tenant", "carol", "--live-requests", "5", "--tokens-per-minute", "20,000"])
    assert shown.exit_code == 0, shown.output
    assert "tenant carol: interactive requests at once 5, tokens per minute 20,000, each berth serve process " \
           "counting its own" in shown.output
    half = runner.invoke(main, ["tenant", "carol", "--live-requests", "default"])
    assert (f"interactive requests at once {settings.http_tenant_live_requests} (BERTH_HTTP_TENANT_LIVE_REQUESTS), "
            "tokens per minute 20,000,") in half.output, half.output
    bad = runner.invoke(main, ["tenant", "carol", "--tokens-per-minute", "lots"])
    assert bad.exit_code == 2 and "--tokens-per-minute" in bad.output, bad.output

    submitted = runner.invoke(main, ["submit", str(write_requests(tmp_path / "r.jsonl", 1, max_tokens=4)),
                                     "--tenant", "carol"])
    assert submitted.exit_code == 0, submitted.output
    status = runner.invoke(main, ["status", submitted.output.strip().splitlines()[-1]])
    assert status.exit_code == 0, status.output
    assert "limits    tenant carol: interactive requests at once 32 (BERTH_HTTP_TENANT_LIVE_REQUESTS), tokens " \
           "per minute 20,000," in status.output, status.output


def test_a_server_without_an_engine_worker_serves_the_limits_metrics_on_a_page_of_its_own(tmp_path, tiny_llama_dir):
    """With a broker, ``berth serve`` runs no engine worker whose page would carry the limits' metrics:
    it serves them itself on ``metrics_port`` (here the embedded settings without a worker stand in),
    and stops serving them when it stops."""
    import urllib.error
    import urllib.request

    from tests.support.processes import free_port
    from tests.support.serving import serving

    port = free_port()
    settings = embedded_settings(tiny_llama_dir, tmp_path, metrics_port=port)
    with serving(settings, worker=False):
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    for family in ("berth_tenant_interactive_live_requests", "berth_tenant_interactive_tokens_last_minute",
                   "berth_interactive_rate_limited_total"):
        assert f"# TYPE {family} " in page, page
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
