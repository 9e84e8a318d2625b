"""The engine worker's metrics by class (interactive, batch): time to first token, time between tokens,
and tokens computed, read from its /metrics page while ``berth serve`` runs both kinds of work."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.jobs_env import TINY_NAME, request_line, tiny_settings
from tests.support.processes import free_port
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for
from worker.metrics import CountedHistogram, WorkerMetrics

BATCH_TOKENS = (5, 7, 6)  # max_tokens of each batch line (EOS ignored: exactly these many)
LIVE_TOKENS = (4, 8)



def _samples(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_both_classes_are_measured_and_their_shares_add_up(tmp_path, tiny_llama_dir):
    from worker.engine.engine import Engine

    port = free_port()
    settings = embedded_settings(tiny_llama_dir, tmp_path, metrics_port=port)
    # one computed token per output token but the last: no draft tokens scored beside them (they are computed
    # tokens too; tests/engine/test_speculation.py counts them)
    engine = Engine(tiny_settings(tiny_llama_dir, speculation="off"))
    lines = []
    for i, n in enumerate(BATCH_TOKENS):
        line = request_line(i, max_tokens=n)
        line["body"]["ignore_eos"] = True
        lines.append(line)
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with serving(settings, engine=engine) as server:
        c = client(server, key_for(settings, "alice"))
        batch = c.batches.create(input_file_id=upload(c, path).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        chunks = list(c.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=LIVE_TOKENS[0], temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        whole = c.completions.create(model=TINY_NAME, prompt="Once upon", max_tokens=LIVE_TOKENS[1], temperature=0,
                                     extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == LIVE_TOKENS[1]
        assert wait_for(c, batch.id).request_counts.completed == len(BATCH_TOKENS)
        metrics = _samples(port)

    def value(name: str, **labels) -> float:
        return metrics.get((name, tuple(sorted(labels.items()))), 0.0)

    assert engine.stats.preemptions == 0  # so each sequence computes each output token but its last once
    for cls, tokens in (("batch", BATCH_TOKENS), ("interactive", LIVE_TOKENS)):
        assert value("berth_time_to_first_token_seconds_count", **{"class": cls}) == len(tokens)
        assert value("berth_time_to_first_token_seconds_sum", **{"class": cls}) > 0
        gaps = value("berth_inter_token_seconds_count", **{"class": cls})
        assert gaps == sum(n - 1 for n in tokens), cls  # one per token after a sequence's first
        assert value("berth_inter_token_seconds_bucket", **{"class": cls, "le": "+Inf"}) == gaps
        assert value("berth_computed_tokens_total", **{"class": cls, "kind": "output"}) == gaps
        assert value("berth_computed_tokens_total", **{"class": cls, "kind": "prompt"}) > 0
    prompt = sum(value("berth_computed_tokens_total", **{"class": cls, "kind": "prompt"})
                 for cls in ("batch", "interactive"))
    assert prompt == value("berth_prefill_tokens_total")  # the classes' prompt tokens are all the prompt tokens
    computed = {cls: sum(value("berth_computed_tokens_total", **{"class": cls, "kind": k})
                         for k in ("prompt", "output")) for cls in ("batch", "interactive")}
    shares = {cls: n / sum(computed.values()) for cls, n in computed.items()}
    assert all(s > 0 for s in shares.values()) and abs(sum(shares.values()) - 1) < 1e-9, shares
    # berth serve's interactive limits, on the same page: alice's two requests are over, their tokens in the window
    assert metrics[("berth_tenant_interactive_live_requests", (("tenant", "alice"),))] == 0
    assert value("berth_tenant_interactive_tokens_last_minute", tenant="alice") > whole.usage.total_tokens


def test_a_counted_histogram_is_a_histogram():
    """Several observations at once are the same buckets, count and sum as one at a time."""
    metrics = WorkerMetrics()
    one = CountedHistogram("one_at_a_time", "x", "class", (0.1, 1.0), metrics.registry)
    many = CountedHistogram("many_at_once", "x", "class", (0.1, 1.0), metrics.registry)
    for value, count in ((0.05, 3), (0.1, 2), (0.5, 4), (7.0, 1)):
        for _ in range(count):
            one.observe("batch", value)
        many.observe("batch", value, count)
    get = metrics.registry.get_sample_value
    for le, want in (("0.1", 5), ("1.0", 9), ("+Inf", 10)):
        assert get("one_at_a_time_bucket", {"class": "batch", "le": le}) == want
        assert get("many_at_once_bucket", {"class": "batch", "le": le}) == want
    assert get("many_at_once_count", {"class": "batch"}) == 10
    assert abs(get("many_at_once_sum", {"class": "batch"}) - (0.15 + 0.2 + 2.0 + 7.0)) < 1e-9
    assert get("many_at_once_count", {"class": "interactive"}) is None
