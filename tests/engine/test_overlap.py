"""Overlapped steps (``async_scheduling``): a step is launched before the host reads the tokens of the one
before. Outputs must be those of the serial engine, token for token, whatever else runs: stop strings found
a step late, seeded draws, logprobs, n > 1, preemption, the prefix cache naming blocks whose last token was
in flight, grammars and penalties (which step serially), and checkpoints taken between steps."""

from __future__ import annotations

import pytest

from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams, StructuredOutput


def _mixed_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12 + i % 9, temperature=0.0 if i % 2 else 0.9, seed=i,
                           stop=[" the"] if i % 5 == 0 else None, logprobs=2 if i % 7 == 0 else None,
                           n=2 if i % 11 == 3 else 1, min_tokens=3 if i % 6 == 1 else 0)
            for i in range(n)]


def _texts(outputs) -> list:
    """Tokens, text and finish reason exactly; logprobs to float32's rounding (a step's rows differ when a
    sequence ends a step later, and a matrix product's rounding with them)."""
    return [[(c.token_ids, c.text, c.finish_reason,
              [(lp["token_id"], pytest.approx(lp["logprob"], rel=1e-4, abs=1e-5), [t for t, _ in lp["top"]])
               for lp in c.logprobs or ()]) for c in o.completions] for o in outputs]


def _prompts(text_ids: list[int], n: int) -> list[list[int]]:
    # prompts sharing a 40-token prefix (prefix cache hits across block boundaries), of varied lengths
    return [text_ids[:40] + text_ids[100 + 7 * i: 100 + 7 * i + 3 + i % 29] for i in range(n)]


@pytest.mark.parametrize("kv_memory", ["64MiB", "160KiB"])  # the small cache preempts (recompute)
def test_overlapped_steps_give_the_serial_engines_outputs(tiny_loaded, text_ids, kv_memory):
    prompts, params = _prompts(text_ids, 30), _mixed_params(30)
    results, engines = {}, {}
    for mode in ("off", "on"):
        engine = engines[mode] = Engine(loaded=tiny_loaded, async_scheduling=mode, kv_memory=kv_memory,
                                        max_num_batched_tokens=48, max_num_seqs=12, block_size=16)
        results[mode] = _texts(engine.generate(prompts, params))
    assert engines["on"].overlap and not engines["off"].overlap
    assert results["on"] == results["off"]
    if kv_memory == "160KiB":
        assert engines["on"].stats.preemptions > 0, "the small cache never preempted: the test lost its point"
    assert engines["on"].stats.prompt_tokens_cached > 0
    # every block the prefix cache names holds what its name says: a second run finds the same hits
    again = _texts(engines["on"].generate(prompts, params))
    assert again == results["off"]


def test_default_model_greedy_and_seeded_outputs_are_the_same_overlapped(smol_loaded, text_ids):
    prompts, params = _prompts(text_ids, 12), _mixed_params(12)
    on = Engine(loaded=smol_loaded, async_scheduling="on", kv_memory="64MiB", max_num_batched_tokens=64)
    off = Engine(loaded=smol_loaded, async_scheduling="off", kv_memory="64MiB", max_num_batched_tokens=64)
    assert _texts(on.generate(prompts, params)) == _texts(off.generate(prompts, params))


def test_grammars_and_penalties_run_beside_overlapped_steps(tiny_loaded, text_ids):
    schema = StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, '
                                             '"required": ["a"], "additionalProperties": false}')
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured=schema if i % 3 == 0 else None,
                             repetition_penalty=1.3 if i % 3 == 1 else 1.0) for i in range(9)]
    prompts = _prompts(text_ids, 9)
    on = _texts(Engine(loaded=tiny_loaded, async_scheduling="on", kv_memory="64MiB").generate(prompts, params))
    off = _texts(Engine(loaded=tiny_loaded, async_scheduling="off", kv_memory="64MiB").generate(prompts, params))
    assert on == off


def test_a_token_in_flight_is_neither_in_a_checkpoint_nor_in_a_named_block(tiny_loaded, text_ids):
    """Between steps, a sequence's newest token is on the device: a checkpoint holds the tokens the host has
    read and the blocks named from them, and restored in another engine it finishes with the same text."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = text_ids[:61]
    alone = Engine(loaded=tiny_loaded, async_scheduling="off", kv_memory="64MiB").generate([prompt], params)
    engine = Engine(loaded=tiny_loaded, async_scheduling="on", kv_memory="64MiB", block_size=16)
    engine.add_request(Request("r", prompt, params))
    for _ in range(20):
        engine.step()
    seq = engine.requests["r"].sequences[0]
    assert seq.inflight == 1 and seq.num_output_tokens == len(seq.output_token_ids) + 1
    state = engine.request_state("r")
    (sample,) = state.samples
    assert sample.output_token_ids == alone[0].completions[0].token_ids[:len(sample.output_token_ids)]
    # the in-flight step computes the newest known token: its block is full and named (the device writes it
    # before any read of the blocks, in stream order)
    assert len(sample.block_hashes) == (61 + len(sample.output_token_ids)) // 16
    data = engine.read_kv_blocks(sample.block_ids)
    other = Engine(loaded=tiny_loaded, async_scheduling="on", kv_memory="64MiB", block_size=16)
    assert other.load_kv_blocks(sample.block_hashes, data) == len(sample.block_hashes)
    other.add_request(Request("r", prompt, params, resume_output_ids=[sample.output_token_ids]))
    done = []
    while other.has_unfinished():
        done += other.step()
    assert done[0].completions[0].token_ids == alone[0].completions[0].token_ids
    # all but the block of the last token, which must be computed to give the next token's logits
    assert other.stats.prompt_tokens_cached == 16 * ((61 + len(sample.output_token_ids) - 1) // 16)


def test_an_aborted_request_with_a_token_in_flight_leaves_nothing_behind(tiny_loaded, text_ids):
    engine = Engine(loaded=tiny_loaded, async_scheduling="on", kv_memory="64MiB")
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(Request(f"r{i}", text_ids[:20 + i], params))
    for _ in range(5):
        engine.step()
    assert engine.abort("r1")
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(o.request_id for o in done) == ["r0", "r2"]
    assert all(len(o.completions[0].token_ids) == 30 for o in done)
    assert engine.block_manager.num_used_blocks == 0
