"""Structured outputs through the engine on the default model: every kind's output keeps its grammar,
and a constraint composes with n, seeds, mixed batches, resumes, failed steps and preemption, while a
spec that does not compile, or compiles slowly, touches no other request."""

from __future__ import annotations

import json
import re
import threading
import uuid

import jsonschema
import pytest
import torch

from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams, StructuredOutput
from worker.engine.structured import grammar

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA = StructuredOutput("json_schema", json.dumps(PERSON, sort_keys=True))
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "it depends"]


def new_engine(smol_loaded, kv_memory="256MiB") -> Engine:
    """One torch thread: on a machine shared with other jobs two spin-waiting threads run several times slower."""
    return Engine(loaded=smol_loaded, kv_memory=kv_memory, threads=1)


@pytest.fixture(scope="module")
def engine(smol_loaded):
    return new_engine(smol_loaded)


@pytest.fixture(scope="module")
def chat(smol_loaded):
    tokenizer = smol_loaded.tokenizer

    def ids(text: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    return ids


def run(engine: Engine, requests: list[Request], step=None) -> dict:
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        for out in (step or engine.step)():
            done[out.request_id] = out
    return done


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.completions]


def test_each_kind_of_output_keeps_its_grammar(engine, chat):
    prompt = chat('Describe a person named Ana, aged 31, as JSON, like {"name": "Bo", "age": 5}.')
    specs = {"schema": SCHEMA, "object": StructuredOutput("json_object"), "regex": StructuredOutput("regex", REGEX),
             "choice": StructuredOutput("choice", json.dumps(CHOICES)),
             "grammar": StructuredOutput("grammar", 'root ::= "A" [0-9] [0-9]? "!"')}
    done = run(engine, [Request(k, prompt, SamplingParams(max_tokens=32, temperature=0, structured=s))
                        for k, s in specs.items()])
    text = {k: out.completions[0].text for k, out in done.items()}
    assert all(out.completions[0].finish_reason == "stop" for out in done.values()), text
    jsonschema.validate(json.loads(text["schema"]), PERSON)
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch(REGEX, text["regex"]), text["regex"]
    assert text["choice"] in CHOICES
    assert re.fullmatch(r"A[0-9]{1,2}!", text["grammar"]), text["grammar"]
    assert engine.block_manager.num_used_blocks == 0 or engine.settings.enable_prefix_cache


def test_too_few_tokens_end_with_length(engine, chat):
    out = run(engine, [Request("short", chat("A person as JSON."),
                               SamplingParams(max_tokens=4, temperature=0, structured=SCHEMA))])["short"]
    c = out.completions[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    assert c.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_seeded_samples_are_valid_and_independent_of_the_batch(engine, chat):
    prompt = chat("Invent a person and give them as JSON.")
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=11, n=2, structured=SCHEMA)
    free = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    others = [chat("Write one sentence about the sea."), chat("Count to five.")]

    first = run(engine, [Request("c", prompt, constrained)] + [Request(f"u{i}", p, free) for i, p in enumerate(others)])
    alone = run(engine, [Request("c", prompt, constrained)])
    unconstrained = run(engine, [Request(f"u{i}", p, free) for i, p in enumerate(others)])
    assert len(first["c"].completions) == 2
    for c in first["c"].completions:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert tokens(first["c"]) == tokens(alone["c"]), "the same seed gave another text in another batch"
    assert tokens(first["c"])[0] != tokens(first["c"])[1], "the two samples must draw different numbers"
    for rid in ("u0", "u1"):
        assert tokens(first[rid]) == tokens(unconstrained[rid]), "a constrained neighbour changed a free row"


def test_a_resumed_request_rebuilds_its_matchers(engine, chat):
    prompt = chat("Invent a person and give them as JSON.")
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=2, structured=SCHEMA)
    whole = tokens(run(engine, [Request("w", prompt, params)])["w"])
    partial = [ids[:6] for ids in whole]
    resumed = run(engine, [Request("r", prompt, params, resume_output_ids=partial)])["r"]
    assert tokens(resumed) == whole


def test_a_failed_step_and_preemption_do_not_accept_a_token_twice(smol_loaded, chat):
    """Preemption by recompute and a step that raises (its requests set back and stepped again in
    halves) both run a constrained request's tokens again: its text must not change."""
    prompts = [chat("Invent a person and give them as JSON."), chat("Write one sentence about the sea.")]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=9, structured=SCHEMA),
              SamplingParams(max_tokens=24, temperature=0.8, seed=9)]
    requests = lambda: [Request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]  # noqa: E731
    clean = run(new_engine(smol_loaded), requests())
    engine = new_engine(smol_loaded, "4MiB")  # room for one of them at a time, near the end
    original, calls = engine.runner.execute, {"n": 0}

    def execute(step_input):  # one decode step of both raises, as a kernel fault would
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("injected fault")
        return original(step_input)

    engine.runner.execute = execute
    failed_once = run(engine, requests())
    assert calls["n"] > 8 and all(out.error is None for out in failed_once.values())
    assert engine.stats.preemptions > 0
    assert {k: tokens(v) for k, v in failed_once.items()} == {k: tokens(v) for k, v in clean.items()}


def test_a_spec_that_does_not_compile_fails_that_request_alone(engine, chat):
    bad = StructuredOutput("json_schema", '{"type": "objekt"}')
    done = run(engine, [Request("bad", chat("Hi"), SamplingParams(max_tokens=8, structured=bad)),
                        Request("good", chat("Hi"), SamplingParams(max_tokens=8, temperature=0))])
    assert not done["bad"].completions and "GrammarError" in done["bad"].error and "objekt" in done["bad"].error
    assert done["good"].error is None and len(done["good"].completions[0].token_ids) == 8


def held_compiles(monkeypatch) -> threading.Event:
    """Every compile from now on waits (at most a minute) until the returned event is set."""
    release = threading.Event()
    original = grammar.Compiler.compile

    def held_compile(self, spec):
        release.wait(timeout=60)
        return original(self, spec)

    monkeypatch.setattr(grammar.Compiler, "compile", held_compile)
    return release


def test_a_slow_compile_holds_nothing_and_blocks_no_one(engine, chat, monkeypatch):
    release = held_compiles(monkeypatch)
    slow = StructuredOutput("regex", f"[a-z]{{3}}-{uuid.uuid4().hex[:6]}")  # compiled nowhere before
    engine.add_request(Request("slow", chat("Hi"), SamplingParams(max_tokens=16, temperature=0, structured=slow)))
    engine.add_request(Request("free", chat("Hi"), SamplingParams(max_tokens=8, temperature=0)))
    finished = {}
    while "free" not in finished:
        finished.update({out.request_id: out for out in engine.step()})
        assert not any(seq.block_table for seq in engine.requests["slow"].sequences), "it took KV blocks"
        assert engine.requests["slow"].sequences[0] not in engine.scheduler.running
    assert engine.num_waiting == 1 and "slow" not in finished
    release.set()
    finished.update(run(engine, []))
    assert re.fullmatch(slow.value, finished["slow"].completions[0].text)


SLOW_PATTERN = "([a-z]{1,50}){1,50}"  # nested counted repetitions in a schema's pattern: minutes of compile


def slow_spec() -> StructuredOutput:
    return StructuredOutput("json_schema",
                            json.dumps({"type": "string", "pattern": uuid.uuid4().hex[:6] + SLOW_PATTERN}))


def test_a_compile_past_its_time_fails_its_request_alone(engine, chat, smol_loaded):
    """A grammar the library cannot finish in time (a schema whose pattern it takes minutes over)
    fails its request with the setting to raise, at the door and in the engine; the neighbour finishes."""
    with pytest.raises(grammar.GrammarError, match="did not compile within 0.5 s"):
        grammar.check(slow_spec(), smol_loaded.tokenizer, grammar.CompileRules(seconds=0.5))
    stuck = slow_spec()
    settings, engine.settings = engine.settings, engine.settings.model_copy(update={"structured_compile_seconds": 1.0})
    try:
        done = run(engine, [Request("stuck", chat("Hi"), SamplingParams(max_tokens=4, temperature=0, structured=stuck)),
                            Request("free", chat("Hi"), SamplingParams(max_tokens=24, temperature=0,
                                                                       ignore_eos=True))])
    finally:
        engine.settings = settings
    assert "BERTH_STRUCTURED_COMPILE_SECONDS" in done["stuck"].error and not done["stuck"].completions
    assert done["free"].error is None and len(done["free"].completions[0].token_ids) == 24


def test_the_mask_covers_the_models_padding_ids(smol_loaded):
    tokenizer = smol_loaded.tokenizer
    compiler = grammar.compiler_for(tokenizer)
    matcher = grammar.new_matcher(compiler.submit(StructuredOutput("choice", '["yes"]')).result())
    bitmask = grammar.fill_bitmask([matcher], compiler.vocab_size)
    logits = torch.zeros(2, compiler.vocab_size + 64)  # the model's width past the tokenizer's
    grammar.apply_bitmask(logits, [1], bitmask)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) and "yes".startswith(tokenizer.decode([t])) for t in allowed)
    assert torch.isfinite(logits[0]).all(), "an unconstrained row was masked"


def test_check_names_what_is_wrong(smol_loaded):
    tokenizer = smol_loaded.tokenizer
    grammar.check(StructuredOutput("choice", '["a", "b"]'), tokenizer)
    for spec, words in [(StructuredOutput("regex", "a(b"), "parenthesis"),
                        (StructuredOutput("choice", "[]"), "non-empty"),
                        (StructuredOutput("grammar", "root ::= foo"), '"foo" is not defined'),
                        (StructuredOutput("json_schema", "{oops"), "Failed to parse JSON")]:
        with pytest.raises(grammar.GrammarError, match=re.escape(words)):
            grammar.check(spec, tokenizer)
