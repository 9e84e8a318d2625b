"""The simulated device (``--simulated-device``): its roofline against the figures it is built from, its
timeline as a CUDA stream behaves, and the engine on it: reproducible tokens, every feature running, the
same outputs overlapped or not."""

from __future__ import annotations

import time

import pytest

from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.kv_view import fingerprint
from worker.engine.request import Request, SamplingParams, StructuredOutput
from worker.engine.simulated_device import GPUS, SHAPES, Timeline, parse, step_seconds

H200, LLAMA_8B = GPUS["h200"], SHAPES["llama-3-8b"]


def test_the_8b_shape_is_llama_3_8b():
    assert LLAMA_8B.weight_bytes == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)  # 8.03B less the lookup
    assert LLAMA_8B.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 kv heads x 128 x K and V x bf16


def test_a_decode_step_costs_what_the_roofline_says():
    bandwidth = H200.hbm_bytes_per_s * H200.bandwidth_share
    one = step_seconds(H200, LLAMA_8B, 1, 100, 100, 1)
    assert one == pytest.approx(LLAMA_8B.weight_bytes / bandwidth, rel=0.05)  # the weights, once
    # 256 sequences at 256 tokens of context: the 4-8 ms of an H200 decode step of an 8B model
    full = step_seconds(H200, LLAMA_8B, 256, 256 * 256, 256 * 256, 256)
    assert 4e-3 < full < 8e-3
    assert full - one == pytest.approx(256 * 256 * LLAMA_8B.kv_bytes_per_token / bandwidth, rel=0.1)
    # a prefill chunk of 8192 tokens is bound by FLOPs, not bytes
    prefill = step_seconds(H200, LLAMA_8B, 8192, 8192 * 4096, 8192, 1)
    s = LLAMA_8B
    flops = 2 * s.layers * s.layer_params * 8192 + 4 * s.layers * s.heads * s.head_dim * 8192 * 4096
    assert prefill == pytest.approx(flops / (H200.bf16_flops * H200.flops_share), rel=0.1)
    assert step_seconds(GPUS["h100"], LLAMA_8B, 256, 256 * 256, 256 * 256, 256) > full  # less bandwidth


def test_the_timeline_runs_work_in_order_and_waits_release_the_host():
    timeline = Timeline()
    start = time.perf_counter()
    first = timeline.enqueue(0.05)
    second = timeline.enqueue(0.05)
    assert second == pytest.approx(first + 0.05) and timeline.busy_seconds == pytest.approx(0.1)
    assert time.perf_counter() - start < 0.05  # enqueueing returns at once, as a kernel launch does
    timeline.wait(second)
    assert time.perf_counter() >= second
    assert timeline.waited_seconds > 0


def test_a_wrong_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="h200:llama-3-8b"):
        parse("a100:llama-3-8b")
    with pytest.raises(ValueError, match="GPU:SHAPE"):
        Settings(simulated_device="h200")


def _simulated(smol_loaded, **kw) -> Engine:
    return Engine(loaded=smol_loaded, simulated_device="h200:llama-3-8b", **kw)


def test_the_engine_on_a_simulated_device_is_reproducible_and_overlapped_by_default(smol_loaded):
    prompts = [[1 + (i * 7 + j) % 500 for j in range(20 + i)] for i in range(16)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)
              for i in range(16)]
    on, off = _simulated(smol_loaded), _simulated(smol_loaded, async_scheduling="off")
    assert on.overlap and not off.overlap
    first = [o.completions[0].token_ids for o in on.generate(prompts, params)]
    assert first == [o.completions[0].token_ids for o in off.generate(prompts, params)]
    assert first == [o.completions[0].token_ids for o in on.generate(prompts, params)]
    assert all(len(t) == 24 for t in first) and len({tuple(t) for t in first}) == 16
    assert on.runner.timeline.busy_seconds > 0
    # the KV cache: what an H200 holds beside the 8B weights (in blocks of 16 tokens)
    assert on.runner.num_blocks == pytest.approx((0.9 * 141e9 - LLAMA_8B.weight_bytes) / (16 * 131072), rel=0.01)


def test_every_feature_runs_on_a_simulated_device(smol_loaded):
    engine = _simulated(smol_loaded)

    def no_step_fails(scheduled, scheduler, exc):  # a retried step would hide a feature the device lacks
        raise AssertionError(f"a step failed: {exc!r}")

    engine.isolation.step_failed = no_step_fails
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    params = {"logprobs": SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
              "grammar": SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput("json_schema",
                                                                                                    schema)),
              "n": SamplingParams(max_tokens=8, temperature=0.8, n=3, seed=4),
              "n_greedy": SamplingParams(max_tokens=8, temperature=0.0, n=4),
              "penalty": SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0),
              "min_tokens": SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8)}
    for name, p in params.items():
        engine.add_request(Request(name, [1, 2, 3, 4, 5], p))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    assert all(o.error is None for o in done.values())
    assert len(done["logprobs"].completions[0].logprobs[0]["top"]) == 3
    assert done["grammar"].completions[0].text.startswith("{")
    assert len(done["n"].completions) == 3 and len(done["n_greedy"].completions) == 4
    assert len(done["min_tokens"].completions[0].token_ids) == 8


def test_a_simulated_devices_blocks_are_never_taken_for_a_models(smol_loaded, smol_path):
    assert fingerprint(smol_path, Settings(simulated_device="h200:llama-3-8b")) != fingerprint(smol_path, Settings())


def test_the_job_index_is_fed_while_the_device_runs_a_step(smol_loaded):
    """A job's prompts and outputs are queued for its suffix index, not walked on the loop's critical path; the
    engine feeds them while it would wait for the device (``Engine._resolve``). Here more sequences run than
    auto drafts for, so no proposal feeds the index: only those waits do."""
    engine = _simulated(smol_loaded, speculation="auto", speculation_max_running=1)
    jobs = engine.speculation.jobs
    for i in range(12):
        engine.add_request(Request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(40)],
                                   SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True),
                                   tenant="t", job="j"))
    assert jobs.pending == 12 and jobs._tries[("t", "j")].num_nodes == 1  # queued, not walked
    finished = 0
    while finished < 6:
        finished += len(engine.step())
    assert jobs.pending < 3 and jobs._tries[("t", "j")]._count[0] >= 12 * 40  # the prompts and outputs so far
    assert engine.stats.draft_tokens == 0


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params, tenant="t", job="j"))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.completions[0].token_ids) for o in engine.step())
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_its_text_is_a_function_of_the_whole_context_however_it_was_computed(smol_loaded):
    """Prompts of one length that end alike (as chat prompts end in the template's assistant header) and
    differ earlier write different text; one prompt writes one text whether it ran in one chunk or in
    chunks of 16, its prefix came from the cache, or its tokens were drafts verified in one step."""
    tail = list(range(100, 140))
    prompts = [[1 + i, 2 + i] + [7] * 20 + tail for i in range(6)]
    plain = _run(_simulated(smol_loaded, speculation="off"), prompts)
    assert len({tuple(t) for t in plain}) == 6

    chunked = _simulated(smol_loaded, speculation="off", max_num_batched_tokens=16)
    assert _run(chunked, prompts) == plain
    assert _run(chunked, prompts[:1]) == plain[:1] and chunked.stats.prompt_tokens_cached >= 48

    # the job's suffix index holds the first run's outputs: the second's drafts from it are accepted
    drafted = _simulated(smol_loaded, speculation="ngram:4")
    assert _run(drafted, prompts) == plain
    accepted = drafted.stats.accepted_tokens
    assert _run(drafted, prompts) == plain and drafted.stats.accepted_tokens - accepted >= 6 * 12
