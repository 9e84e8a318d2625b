"""Prefix cache, copy-on-write for n > 1, seeded sampling, stops, logprobs, resume and the KV budget."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.models import cut_prompts
from worker.engine.engine import Engine, RequestRejected
from worker.engine.request import Request, SamplingParams


@pytest.fixture(scope="module")
def smol_engine(smol_loaded):
    return Engine(loaded=smol_loaded, kv_memory="1GiB", max_num_batched_tokens=512)


def run(engine, prompts, params, order=None):
    """Add ``prompts`` in ``order`` (default: as given), run to completion, outputs by prompt index."""
    order = order or list(range(len(prompts)))
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i in order:
        engine.add_request(Request(f"r{i}", prompts[i], plist[i]))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[int(out.request_id[1:])] = out
    return [done[i] for i in range(len(prompts))]


def test_shared_prefix_is_computed_once(tiny_loaded, text_ids):
    prefix = cut_prompts(text_ids, [256])[0]
    suffixes = cut_prompts(text_ids, [random.Random(i).randint(1, 40) for i in range(32)], stride=313)
    prompts = [prefix + s for s in suffixes]
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", block_size=16, max_num_batched_tokens=512)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert engine.stats.prompt_tokens_computed == 256 + sum(map(len, suffixes))
    assert engine.stats.prompt_tokens_cached == 31 * 256
    alone = Engine(loaded=tiny_loaded, kv_memory="64MiB", enable_prefix_cache=False)
    reference = alone.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert alone.stats.prompt_tokens_computed == sum(map(len, prompts))
    assert [o.completions[0].token_ids for o in outs] == [o.completions[0].token_ids for o in reference]


def test_n_samples_share_the_prompt_copy_on_write(tiny_loaded, text_ids):
    prompt = cut_prompts(text_ids, [37])[0]  # ends inside a block, so the first write must copy
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", block_size=16)
    single = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, n=3))[0]
    assert engine.stats.prompt_tokens_computed == 2 * 37 - 32, "the n=3 request recomputed its cached prompt"
    assert [c.token_ids for c in greedy.completions] == [single.completions[0].token_ids] * 3
    sampled = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=3))[0]
    texts = [c.token_ids for c in sampled.completions]
    assert len(set(map(tuple, texts))) == 3, "samples of one request must draw different numbers"
    again = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=3))[0]
    assert [c.token_ids for c in again.completions] == texts
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_seeded_sampling_is_independent_of_the_batch(smol_engine, text_ids):
    prompts = cut_prompts(text_ids, [random.Random(i).randint(5, 80) for i in range(32)])
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, top_k=50, seed=1000 + i)
              for i in range(32)]
    alone = [run(smol_engine, [prompts[i]], [params[i]])[0].completions[0].token_ids for i in (0, 17, 31)]
    batch = [o.completions[0].token_ids for o in run(smol_engine, prompts, params)]
    order = list(range(32))
    random.Random(3).shuffle(order)
    shuffled = [o.completions[0].token_ids for o in run(smol_engine, prompts, params, order)]
    assert [batch[0], batch[17], batch[31]] == alone
    assert shuffled == batch
    other_seed = run(smol_engine, [prompts[0]], [SamplingParams(max_tokens=16, temperature=0.8, seed=5)])[0]
    assert other_seed.completions[0].token_ids != batch[0]


def test_stop_strings_ids_and_lengths(smol_engine):
    tok = smol_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    full = run(smol_engine, [prompt], SamplingParams(max_tokens=40, temperature=0))[0].completions[0]
    assert full.finish_reason in ("stop", "length") and "5" in full.text
    cut = full.text.index("5")
    by_string = run(smol_engine, [prompt], SamplingParams(max_tokens=40, temperature=0, stop=("5",)))[0]
    assert by_string.completions[0].text == full.text[:cut]
    assert by_string.completions[0].finish_reason == "stop"
    third = full.token_ids[2]
    by_id = run(smol_engine, [prompt], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(third,)))[0]
    assert by_id.completions[0].token_ids == full.token_ids[:3] and by_id.completions[0].finish_reason == "stop"
    short = run(smol_engine, [prompt], SamplingParams(max_tokens=3, temperature=0))[0].completions[0]
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    eos = smol_engine.eos_token_ids[0]
    hello = list(tok("Hello")["input_ids"])
    forced = run(smol_engine, [hello], SamplingParams(max_tokens=8, temperature=0, min_tokens=8))[0].completions[0]
    assert len(forced.token_ids) == 8 and eos not in forced.token_ids


def test_logprobs_are_those_of_the_model(smol_engine, smol_loaded, hf_smol):
    prompt = list(smol_engine.tokenizer("The capital of France is")["input_ids"])
    out = run(smol_engine, [prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].completions[0]
    assert len(out.logprobs) == 5
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].float(), -1)
    for j, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert entry["token_id"] == out.token_ids[j]
        assert abs(entry["logprob"] - row[entry["token_id"]].item()) < 1e-3
        assert [t for t, _ in entry["top"]] == row.topk(3).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resume_from_generated_tokens_continues_identically(smol_engine, text_ids, temperature):
    """A request restored with its first tokens (as from a checkpoint) ends as an undisturbed one."""
    prompt = cut_prompts(text_ids, [50])[0]
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=99, ignore_eos=True)
    whole = run(smol_engine, [prompt], params)[0].completions[0].token_ids
    smol_engine.add_request(Request("resumed", prompt, params, resume_output_ids=[whole[:9]]))
    outs = []
    while smol_engine.has_unfinished():
        outs += smol_engine.step()
    assert outs[0].completions[0].token_ids == whole
    assert smol_engine.stats.recomputed_tokens >= 8, "the restored tokens were not recomputed into the cache"


def test_kv_budget_is_respected_and_reported(tiny_loaded):
    engine = Engine(loaded=tiny_loaded, kv_memory="256KiB", block_size=16)
    assert engine.runner.kv_bytes <= 256 << 10
    held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert held == engine.runner.kv_bytes
    usage = engine.kv_usage()
    assert usage["blocks_used"] == 0 and usage["blocks_free"] == usage["blocks_total"] == engine.runner.num_blocks
    with pytest.raises(RequestRejected, match="KV cache"):
        engine.add_request(Request("big", [1] * 500, SamplingParams(max_tokens=1000)))
    fraction = Engine(loaded=tiny_loaded, kv_memory=0.01, block_size=16)
    assert 0 < fraction.runner.kv_bytes


def test_checkpoint_state_and_kv_blocks_restore_in_another_engine(tiny_loaded, text_ids):
    """Read a running request's tokens and full KV blocks, load them into a fresh engine, resume:
    only the tail past the last full block is recomputed and the tokens match an undisturbed run."""
    prompt = cut_prompts(text_ids, [70])[0]
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True)
    first = Engine(loaded=tiny_loaded, kv_memory="16MiB", block_size=16)
    whole = first.generate([prompt], params)[0].completions[0].token_ids
    first.add_request(Request("r", prompt, params))
    for _ in range(15):
        first.step()
    state = first.request_state("r")
    (sample,) = state.samples
    assert len(sample.output_token_ids) == 15 and len(sample.block_hashes) == (70 + 14) // 16
    data = first.read_kv_blocks(sample.block_ids)
    second = Engine(loaded=tiny_loaded, kv_memory="16MiB", block_size=16)
    assert second.fingerprint == first.fingerprint
    assert second.load_kv_blocks(sample.block_hashes, data) == len(sample.block_hashes)
    second.add_request(Request("r", state.prompt_token_ids, state.params,
                               resume_output_ids=[sample.output_token_ids]))
    outs = []
    while second.has_unfinished():
        outs += second.step()
    assert outs[0].completions[0].token_ids == whole
    restored = len(sample.block_hashes) * 16
    assert second.stats.prompt_tokens_computed + second.stats.recomputed_tokens == 70 + 14 - restored


def test_a_stop_string_late_in_a_long_output(tiny_loaded):
    """Stop strings are looked for in the last tokens only; one that first appears late in a long
    output still stops it at the same token and cuts the text at the same place as a full search."""
    engine = Engine(loaded=tiny_loaded, kv_memory="16MiB", threads=1)
    tok = engine.tokenizer
    full = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))[0].completions[0]
    text = full.text
    # a stop string across a token boundary late in the text: the tail must hold several tokens
    ids = full.token_ids
    for k in range(int(0.8 * len(ids)), len(ids)):
        before = tok.decode(ids[:k], skip_special_tokens=True)
        if before == text[:len(before)] and len(before) >= 2 and len(text) - len(before) >= 2:
            stop = text[len(before) - 2:len(before) + 2]
            if stop.strip() == stop and len(set(stop)) > 1:
                break
    first = text.index(stop)
    assert first > 100, "pick a stop string that first appears late (the test is too easy)"
    want_tokens = next(n for n in range(1, len(full.token_ids) + 1)
                       if stop in tok.decode(full.token_ids[:n], skip_special_tokens=True))
    stops = ("never \x00", stop)
    assert want_tokens > 4 * max(map(len, stops)) + 8, "the match must lie beyond the decoded window"
    got = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True,
                                                  stop=stops))[0].completions[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == full.token_ids[:want_tokens]
    assert got.text == text[:first]
