"""Blast radius of one, in the engine: a request that makes a step raise fails alone, with its reason;
every request batched with it, of any tenant, finishes as in a clean run."""

from __future__ import annotations

import pytest

from tests.support.models import cut_prompts
from worker.engine.engine import Engine, RequestRejected
from worker.engine.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)


def _requests(text_ids, culprit_params=GREEDY) -> list[Request]:
    prompts = cut_prompts(text_ids, [5, 40, 17, 90, 33, 8, 64, 21])
    out = []
    for i, ids in enumerate(prompts):
        params = culprit_params if i == 3 else (SAMPLED if i % 3 == 0 else GREEDY)
        out.append(Request(f"r{i}", list(ids), params, tenant="alice" if i % 2 else "bob"))
    return out


def _run(engine: Engine, requests: list[Request]) -> dict:
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done


@pytest.fixture
def engine(tiny_loaded):
    return Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_seqs=8)


def _clean(tiny_loaded, text_ids) -> dict:
    return _run(Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_seqs=8), _requests(text_ids))


def _assert_only_culprit_failed(done: dict, clean: dict, reason: str) -> None:
    assert set(done) == set(clean)
    assert done["r3"].error is not None and reason in done["r3"].error and not done["r3"].completions
    for rid, out in clean.items():
        if rid != "r3":
            assert done[rid].error is None
            assert [c.token_ids for c in done[rid].completions] == [c.token_ids for c in out.completions], rid


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_step_failing_for_one_request_fails_it_alone(engine, tiny_loaded, text_ids, when):
    clean = _clean(tiny_loaded, text_ids)
    requests = _requests(text_ids)
    culprit = requests[3]
    original = engine.runner.prepare

    def prepare(scheduled, tables=None):  # the culprit's presence makes the step raise, as a kernel would
        for seq, _ in scheduled:
            if seq.request is culprit and (when == "prefill" or seq.num_output_tokens >= 3):
                raise RuntimeError("injected fault")
        return original(scheduled, tables)

    engine.runner.prepare = prepare
    done = _run(engine, requests)
    _assert_only_culprit_failed(done, clean, "RuntimeError: injected fault")
    assert engine.block_manager.num_used_blocks == 0


def test_an_error_finishing_one_row_fails_that_request_alone(engine, tiny_loaded, text_ids):
    """The culprit's stop string is looked for after each of its tokens (``stop_checker``, which decodes its
    tail): the fourth look raises, as a tokenizer's decode might."""
    clean = _clean(tiny_loaded, text_ids)
    requests = _requests(text_ids, SamplingParams(max_tokens=12, temperature=0, stop=("a stop never written",)))
    original = engine._finish_reason

    def finish_reason(seq, token):
        if seq.request.request_id == "r3" and seq.num_output_tokens == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(seq, token)

    engine._finish_reason = finish_reason
    done = _run(engine, requests)
    _assert_only_culprit_failed(done, clean, "UnicodeDecodeError")


def test_the_engine_refuses_what_it_cannot_run(engine):
    vocab = engine.vocab_size
    bad = [Request("neg", [1, -5, 3]), Request("big", [1, vocab]),
           Request("stop", [1, 2], SamplingParams(stop_token_ids=(vocab + 10,), min_tokens=2)),
           Request("topk", [1, 2], SamplingParams(top_k=vocab + 1)),
           Request("resumed", [1, 2], SamplingParams(max_tokens=4), resume_output_ids=[[5] * 40])]
    for request in bad:
        with pytest.raises(RequestRejected):
            engine.add_request(request)
    assert not engine.has_unfinished()


def test_the_engine_names_the_requests_a_step_will_run_before_running_it(engine, text_ids):
    events = []
    engine.on_start = lambda ids: events.append(("start", sorted(ids)))
    original = engine.runner.execute
    engine.runner.execute = lambda step: (events.append(("execute",)), original(step))[1]
    _run(engine, _requests(text_ids)[:3])
    started = [e for e in events if e[0] == "start"]
    assert sorted(i for e in started for i in e[1]) == ["r0", "r1", "r2"]  # each once
    assert events[0][0] == "start"
    for i, e in enumerate(events):  # every start is followed by the step that runs it
        if e[0] == "start":
            assert events[i + 1] == ("execute",)
