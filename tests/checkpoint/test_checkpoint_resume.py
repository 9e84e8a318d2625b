"""A request killed half-way continues in a fresh engine from its checkpoint, token for token as an
undisturbed run, whether its KV blocks are read back or recomputed; checkpoints that do not apply
are ignored with a warning; the choice between reading and recomputing follows measured rates."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import fields, replace

import pytest
import torch

from storage import open_store
from tests.support.checkpoints import Pointers, checkpointer, prompts, run_steps, stored_states, tiny_engine, tokens
from worker.checkpoint.format import (
    CorruptCheckpoint,
    EngineLimits,
    RequestCheckpoint,
    SampleCheckpoint,
    StateRef,
    decode_run,
    encode_run,
    encode_segment,
    kv_key,
    request_digest,
    runs_holding,
    segment_key,
)
from worker.checkpoint.resume import Restorer, TransferRates
from worker.engine.block_manager import chain_hash, hash_root
from worker.engine.engine import EngineStats
from worker.engine.request import Request, SamplingParams

PARAMS = [SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=48, temperature=0.8, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True)]
PROMPTS = prompts([37, 50, 21], seed=7)
READ = TransferRates(prefill_tokens_per_second=1.0, storage_bytes_per_second=1e12)  # reading is far cheaper
RECOMPUTE = TransferRates(prefill_tokens_per_second=1e12, storage_bytes_per_second=1.0)  # computing is


def _requests() -> list[Request]:
    return [Request(str(i), p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]


@pytest.fixture(scope="module")
def undisturbed(tiny_loaded):
    return tokens(run_steps(tiny_engine(tiny_loaded), None, _requests()))


@pytest.fixture
def store(tmp_path):
    return open_store(f"file://{tmp_path / 'store'}")


@pytest.fixture
def pointers():
    """Where each request's latest state is, as the jobs database would keep it."""
    return Pointers()


@pytest.fixture
def killed_half_way(tiny_loaded, store, pointers):
    return _kill_half_way(tiny_loaded, store, pointers)


def _kill_half_way(tiny_loaded, store, pointers, **engine_settings):
    """Run the requests with checkpoints (KV blocks too) until each has about half its tokens, then
    drop the engine; their latest states by request id."""
    engine = tiny_engine(tiny_loaded, **engine_settings)
    cp = checkpointer(engine, store, pointers, checkpoint_interval=8, checkpoint_kv="always")
    run_steps(engine, cp, _requests(), until=lambda: engine.stats.output_tokens >= 24 * 4)
    assert cp.writer.flush(30)
    cp.close()
    states = stored_states(store, pointers)
    assert len(states) == 3 and all(s.output_tokens >= 16 * len(s.samples) for s in states.values())
    assert all(s.kv_runs for s in states.values())
    return states


def _resume(tiny_loaded, store, rates: TransferRates, pointers: dict[str, str], **engine_settings):
    """A fresh engine restoring every request from ``pointers``; run to the end. (outputs, engine, metrics)"""
    engine = tiny_engine(tiny_loaded, **engine_settings)
    cp = checkpointer(engine, store)
    restorer = Restorer(engine, store, cp, cp.metrics, rates)
    for request in _requests():
        restorer.submit(request, pointers[request.request_id])
    ready, deadline = [], time.monotonic() + 30
    while restorer.pending:
        assert time.monotonic() < deadline
        ready += restorer.ready()
        time.sleep(0.01)
    outputs = run_steps(engine, cp, ready)
    cp.close()
    restorer.close()
    return tokens(outputs), engine, cp.metrics


def _restores(metrics, kv: str) -> float:
    return metrics.registry.get_sample_value("berth_checkpoint_restores_total", {"kv": kv}) or 0


def _computed(engine) -> int:
    return engine.stats.prompt_tokens_computed + engine.stats.recomputed_tokens


def _generated_after_resume(undisturbed, states) -> int:
    """Tokens a resumed run generates: all of them but those its checkpoints held."""
    total = sum(len(t) for samples in undisturbed.values() for t in samples)
    return total - sum(s.output_tokens for s in states.values())


def _tokens_at_checkpoint(states) -> int:
    """Prompt tokens plus every sample's generated tokens: what the engine must hold again."""
    return sum(s.prompt_tokens + s.output_tokens for s in states.values())


def test_resume_reading_kv_blocks_continues_token_for_token(tiny_loaded, store, pointers, killed_half_way, undisturbed):
    outputs, engine, metrics = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    assert engine.stats.output_tokens == _generated_after_resume(undisturbed, killed_half_way)
    assert _restores(metrics, "loaded") == 3 and _restores(metrics, "recomputed") == 0
    restored = sum(len(s.block_hashes()) for s in killed_half_way.values()) * 16
    assert _computed(engine) <= _tokens_at_checkpoint(killed_half_way) - restored + 16 * 2, \
        "blocks read back were computed again"
    assert metrics.registry.get_sample_value("berth_checkpoint_restored_tokens_total") == sum(
        s.output_tokens for s in killed_half_way.values())


def test_an_int8_cache_resumes_from_its_own_quantized_blocks(tiny_loaded, tmp_path):
    """int8 blocks go to the store and come back as they are (values and scales in one row): the
    resumed run equals an undisturbed int8 run token for token, and an exact-dtype engine, whose
    fingerprint differs, does not take them."""
    int8 = {"kv_cache_dtype": "int8"}
    undisturbed = tokens(run_steps(tiny_engine(tiny_loaded, **int8), None, _requests()))
    store, pointers = open_store(f"file://{tmp_path / 'store'}"), Pointers()
    states = _kill_half_way(tiny_loaded, store, pointers, **int8)
    outputs, engine, metrics = _resume(tiny_loaded, store, READ, pointers, **int8)
    assert outputs == undisturbed
    assert _restores(metrics, "loaded") == 3 and engine.runner.kv_dtype == torch.uint8
    assert engine.fingerprint != tiny_engine(tiny_loaded).fingerprint
    _, exact_engine, exact_metrics = _resume(tiny_loaded, store, READ, pointers)
    assert _restores(exact_metrics, "loaded") == 0  # another fingerprint: started over, not fed int8 rows
    assert states


def test_resume_recomputing_kv_continues_token_for_token(tiny_loaded, store, pointers, killed_half_way, undisturbed):
    outputs, engine, metrics = _resume(tiny_loaded, store, RECOMPUTE, pointers)
    assert outputs == undisturbed
    assert engine.stats.output_tokens == _generated_after_resume(undisturbed, killed_half_way)
    assert _restores(metrics, "recomputed") == 3 and _restores(metrics, "loaded") == 0
    assert _computed(engine) >= _tokens_at_checkpoint(killed_half_way) - 3 * 16


def test_a_checkpoint_of_another_model_or_corrupt_is_ignored(tiny_loaded, store, pointers, killed_half_way, undisturbed,
                                                             caplog):
    other = killed_half_way["0"]
    _point(store, pointers, "0", other.to_json().replace(other.fingerprint.encode(), b"0" * 32))
    _point(store, pointers, "1", b'{"version": 2, "request_id": "1", "samp')
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, _, metrics = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    assert _restores(metrics, "loaded") == 1
    text = caplog.text
    assert "request 0 starts over: its checkpoint does not apply: it was made by another model" in text
    assert "request 1 starts over: its checkpoint cannot be read" in text


def test_a_corrupt_kv_block_is_recomputed_from_there_on(tiny_loaded, store, pointers, killed_half_way, undisturbed,
                                                        caplog):
    state = killed_half_way["1"]
    victim = state.samples[0].block_hashes[1]
    run = runs_holding(state)[victim]
    key = kv_key(state.fingerprint, run)
    assert victim in decode_run(store.get(key))[0]
    raw = bytearray(store.get(key))
    raw[-5] ^= 0xFF
    store.put(key, bytes(raw))
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, _, _ = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    assert f"the KV run {run.hex()} cannot be read back (not a berth KV run: checksum mismatch)" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_a_kv_run_of_another_dtype_is_refused_and_recomputed(tiny_loaded, store, pointers, killed_half_way, undisturbed,
                                                             caplog, dtype):
    """A run of the engine's shape in another dtype, well formed and checksummed (anyone with store
    access can write one): refused as unreadable, never converted into the float32 cache."""
    state = killed_half_way["1"]
    run = runs_holding(state)[state.samples[0].block_hashes[0]]
    key = kv_key(state.fingerprint, run)
    hashes, data = decode_run(store.get(key))
    assert data.dtype == torch.float32
    store.put(key, encode_run(hashes, data.to(dtype)))
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, _, _ = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    name = str(dtype).removeprefix("torch.")
    assert f"the KV run {run.hex()} cannot be read back (KV blocks of dtype {name}, not float32)" in caplog.text


def test_a_reference_to_a_missing_segment_or_another_key_starts_over(tiny_loaded, store, pointers, killed_half_way,
                                                                     undisturbed, caplog):
    pointers["0"] = str(StateRef(segment_key("gone", 7), 0, 100))
    pointers["1"] = "jobs/batch_1/input.jsonl@0+100"  # a ref is read only if it names a segment
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, _, metrics = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    assert _restores(metrics, "loaded") == 1
    assert "request 0 starts over: the segment of its checkpoint" in caplog.text
    assert ("request 1 starts over: its checkpoint cannot be read: 'jobs/batch_1/input.jsonl@0+100' is not"
            in caplog.text)


_forged = [0]


def _point(store, pointers, request_id: str, raw: bytes) -> None:
    """Write ``raw`` as the state of ``request_id`` in a segment of its own, and point there."""
    _forged[0] += 1
    key = segment_key("forged", _forged[0])
    store.put(key, b"padding" + raw)
    pointers[request_id] = str(StateRef(key, len(b"padding"), len(raw)))


def _forge(store, pointers, state: RequestCheckpoint, kv_runs=None, **changes) -> None:
    """Write ``state`` with every sample changed by ``changes`` (values: functions of the sample)."""
    samples = [replace(s, **{k: f(s) for k, f in changes.items()}) for s in state.samples]
    forged = replace(state, samples=samples, kv_runs=state.kv_runs if kv_runs is None else kv_runs)
    raw, where = encode_segment([forged])
    _forged[0] += 1
    key = segment_key("forged", _forged[0])
    store.put(key, raw)
    pointers[state.request_id] = str(StateRef(key, *where[state.request_id]))


def test_forged_checkpoints_start_over_and_finish_as_a_clean_run(tiny_loaded, store, pointers, killed_half_way,
                                                                 undisturbed, caplog):
    """Anyone with the store can write a checkpoint: one the engine could never have written is
    ignored, never run (too many tokens ran past max_tokens; an id past the vocabulary crashed the step)."""
    states = [killed_half_way[str(i)] for i in range(3)]
    _forge(store, pointers, states[0], output_token_ids=lambda s: s.output_token_ids + [5] * 60)
    _forge(store, pointers, states[1], output_token_ids=lambda s: s.output_token_ids[:-1] + [10 ** 7])
    _forge(store, pointers, states[2], block_hashes=lambda s: [s.block_hashes[0], bytes(16)] + s.block_hashes[2:])
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, engine, metrics = _resume(tiny_loaded, store, READ, pointers)
    assert outputs == undisturbed
    assert _restores(metrics, "loaded") == 0 and _restores(metrics, "recomputed") == 0
    assert engine.stats.output_tokens == sum(len(t) for samples in undisturbed.values() for t in samples)
    text = caplog.text
    assert "request 0 starts over: its checkpoint does not apply: sample 0: " in text and "max_tokens 48" in text
    assert ("request 1 starts over: its checkpoint does not apply: sample 0: token id 10000000 is outside the "
            "model's vocabulary") in text
    assert "request 2 starts over: its checkpoint does not apply: sample 0: KV block 1 is named 0000" in text


def test_a_checkpoint_holds_at_most_max_tokens_minus_one(tiny_loaded, store, pointers, killed_half_way, undisturbed,
                                                         caplog):
    """The engine ends a sample in the step that reaches max_tokens, so it never checkpoints one
    that long: a state one token short resumes (and samples the last one), a state at max_tokens is forged."""
    states = [killed_half_way[str(i)] for i in range(2)]
    _forge(store, pointers, states[0], [], output_token_ids=lambda s: undisturbed["0"][0][:47],
           block_hashes=lambda s: [])
    _forge(store, pointers, states[1], [], output_token_ids=lambda s: undisturbed["1"][0][:48],
           block_hashes=lambda s: [])
    with caplog.at_level(logging.WARNING, "berth.checkpoint"):
        outputs, engine, metrics = _resume(tiny_loaded, store, RECOMPUTE, pointers)
    assert outputs == undisturbed
    assert [len(t) for t in outputs["0"]] == [48]
    assert _restores(metrics, "recomputed") == 2  # requests 0 and 2
    assert "request 0 starts over" not in caplog.text
    assert "request 1 starts over: its checkpoint does not apply: sample 0: 48 generated tokens" in caplog.text


def test_what_a_checkpoint_holds_is_checked_against_the_engine():
    prompt = list(range(3, 3 + 40))
    request = Request("7", prompt, SamplingParams(max_tokens=30, n=2, seed=1))
    limits = EngineLimits(vocab_size=100, max_model_len=64, block_size=16)
    out = [9] * 10
    chain = [chain_hash(b"", prompt[:16])]
    chain.append(chain_hash(chain[0], prompt[16:32]))

    whole_prompt = len(prompt)

    def checkpoint(samples, prompt_tokens=whole_prompt):
        return RequestCheckpoint("7", "fp", request_digest(prompt, request.params), prompt_tokens, samples, 0.0)

    good = [SampleCheckpoint(0, out, chain), SampleCheckpoint(1, out[:3], chain[:1])]
    assert checkpoint(good).mismatch(request, "fp", limits) is None
    forged = {
        "its samples are numbered [0, 0]": [good[0], replace(good[1], index=0)],
        "its samples are numbered [0]": good[:1],
        "sample 1: 30 generated tokens, more than the 29": [good[0], replace(good[1], output_token_ids=[9] * 30)],
        "sample 0: 40 prompt + 24 generated tokens reach the model's context of 64":
            [replace(good[0], output_token_ids=[9] * 24), good[1]],
        "sample 0: token id -1 is outside": [replace(good[0], output_token_ids=[-1]), good[1]],
        "sample 0: token id 100 is outside": [replace(good[0], output_token_ids=[100]), good[1]],
        "sample 1: 3 KV blocks named, more than its 43 tokens fill":
            [good[0], replace(good[1], block_hashes=chain + [bytes(16)])],
        "sample 0: KV block 0 is named": [replace(good[0], block_hashes=chain[::-1]), good[1]],
        "sample 0: KV block 1 is named": [replace(good[0], block_hashes=[chain[0], b"\x01"]), good[1]],
    }
    for reason, samples in forged.items():
        assert reason in (checkpoint(samples).mismatch(request, "fp", limits) or ""), reason
    assert "it counts 39 prompt tokens" in checkpoint(good, 39).mismatch(request, "fp", limits)
    too_many_runs = replace(checkpoint(good), kv_runs=[bytes(16), b"\x01" * 16, b"\x02" * 16])
    assert "it names 3 KV runs for 2 blocks" in too_many_runs.mismatch(request, "fp", limits)
    raw = checkpoint(good).to_json()
    for bad in (raw.replace(b"[9,9,9]", b'[9,"9",9]'), raw.replace(b"[9,9,9]", b"[9,9.5,9]"),
                raw.replace(b"[9,9,9]", b"[9,true,9]"), raw.replace(b'"index":1', b'"index":"1"')):
        assert bad != raw
        with pytest.raises(CorruptCheckpoint, match="is not an integer"):
            RequestCheckpoint.from_json(bad)


def test_a_state_reads_back_as_written_with_every_field():
    state = RequestCheckpoint("r-1", "f" * 32, "d" * 32, 40, [SampleCheckpoint(0, [5, 6], [b"\x01" * 16]),
                                                         SampleCheckpoint(1, [7], [])],
                              1234.5, params={"seed": 3, "temperature": 0.5}, kv_runs=[b"\x01" * 16])
    written = json.loads(state.to_json())
    assert set(written) == {f.name for f in fields(RequestCheckpoint)}  # a field added is a field written
    assert RequestCheckpoint.from_json(state.to_json()) == state


def test_the_estimate_follows_measured_rates():
    rates = TransferRates()
    block_bytes, block_size = 1 << 20, 16  # a large block: 1 MiB for 16 tokens
    stats = EngineStats()
    for _ in range(20):  # steps of 512 prefill tokens each taking 0.1 s: ~5,000 tokens/s
        stats.prompt_tokens_computed += 512
        stats.forward_seconds += 0.1
        rates.observe_step(stats)
    assert rates.prefill_tokens_per_second == pytest.approx(5120, rel=0.01)
    stats.output_tokens += 10_000  # a decode-only step says nothing about prefill
    stats.forward_seconds += 100
    rates.observe_step(stats)
    assert rates.prefill_tokens_per_second == pytest.approx(5120, rel=0.01)
    for _ in range(20):
        rates.observe_read(10 << 20, 1.0)  # a slow store: 10 MiB/s
    assert rates.load_seconds(10, block_bytes) > rates.recompute_seconds(10, block_size)
    for _ in range(20):
        rates.observe_read(10 << 30, 1.0)  # a fast one: 10 GiB/s
    assert rates.load_seconds(10, block_bytes) < rates.recompute_seconds(10, block_size)


def test_a_longrope_sequence_past_its_threshold_names_its_blocks_from_the_long_root():
    """Past a longrope model's threshold a sequence's keys are rotated otherwise, so its blocks hash
    from another root (``worker.model.rotary``): a checkpoint must name them so, and short ones as before."""
    prompt = list(range(3, 3 + 40))
    request = Request("7", prompt, SamplingParams(max_tokens=30))
    limits = EngineLimits(vocab_size=100, max_model_len=128, block_size=16, long_rope_from=48)

    def sample(out, root):
        chain = [chain_hash(root, prompt[:16])]
        chain.append(chain_hash(chain[0], prompt[16:32]))
        digest = request_digest(prompt, request.params)
        return RequestCheckpoint("7", "fp", digest, 40, [SampleCheckpoint(0, out, chain)], 0.0)

    assert sample([9] * 8, b"").mismatch(request, "fp", limits) is None  # 48 tokens: short
    assert "KV block 0 is named" in sample([9] * 8, hash_root(True)).mismatch(request, "fp", limits)
    assert sample([9] * 9, hash_root(True)).mismatch(request, "fp", limits) is None  # 49 tokens: long
    assert "KV block 0 is named" in sample([9] * 9, b"").mismatch(request, "fp", limits)
