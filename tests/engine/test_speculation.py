"""Speculation (worker/engine/speculative/): drafts from a sequence's own tokens, verified in the step.
Greedy outputs must be the engine's without drafts token for token, whatever else a request asks (stop
strings, max_tokens inside a draft, n > 1, logprobs, min_tokens, logit_bias, penalties, a grammar) and
whatever happens to its blocks (preemption, the prefix cache, checkpoints restored elsewhere); and drafts
must actually be accepted, or these tests would prove nothing."""

from __future__ import annotations

import json

import pytest

from tests.support.drafts import draft_params, output_texts
from worker.engine.engine import Engine
from worker.engine.penalties import TokenCounts
from worker.engine.request import Request, SamplingParams, StructuredOutput
from worker.engine.speculative.proposer import NgramIndex
from worker.engine.structured import grammar
from worker.engine.text_delta import TextDelta
from worker.metrics import WorkerMetrics


def _copying_prompts(text_ids: list[int], n: int) -> list[list[int]]:
    """Prompts that repeat a passage and begin it once more: a model goes on copying, drafts are accepted."""
    return [text_ids[50 * i:50 * i + 40] * 2 + text_ids[50 * i:50 * i + 3 + i % 5] for i in range(n)]


def _spoke(engine: Engine) -> None:
    """Speculation ran, and some drafts were accepted and some refused."""
    s = engine.stats
    assert s.draft_tokens > 0 and s.accepted_tokens > 0, "no draft was accepted: the test lost its point"
    assert s.accepted_tokens <= s.draft_tokens and 0 < s.acceptance_rate <= 1


@pytest.fixture
def oracle(monkeypatch):
    """The tiny random model never repeats itself, so prompt lookup finds nothing to draft: its tests draft
    from the outputs of a run without drafts instead, every third position's second draft token wrong, so
    that drafts are accepted whole, in part and not at all. ``teach(prompts, outputs)`` gives the answers."""
    answers: dict[tuple[int, ...], list[int]] = {}

    def propose(self, tokens, k):
        for prompt, output in answers.items():
            if tuple(tokens[:len(prompt)]) == prompt and tokens[len(prompt):] == output[:len(tokens) - len(prompt)]:
                draft = output[len(tokens) - len(prompt):][:k]
                if len(tokens) % 3 == 0 and len(draft) > 1:
                    draft[1] += 1
                return draft
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)

    def teach(prompts, outputs):
        for prompt, out in zip(prompts, outputs):
            answers[tuple(prompt)] = out.completions[0].token_ids + [0] * 8  # drafts past the end: refused
    return teach


def test_default_model_greedy_outputs_are_the_same_with_drafts(smol_loaded, text_ids):
    prompts, params = _copying_prompts(text_ids, 8), draft_params(8)
    off = Engine(loaded=smol_loaded, speculation="off", kv_memory="64MiB")
    on = Engine(loaded=smol_loaded, speculation="ngram:4", kv_memory="64MiB")
    expected = output_texts(off.generate(prompts, params))
    assert output_texts(on.generate(prompts, params)) == expected
    _spoke(on)
    assert off.stats.draft_tokens == 0
    assert on.stats.steps < off.stats.steps  # several tokens a step
    assert on.stats.output_tokens == off.stats.output_tokens


@pytest.mark.parametrize(("kv_memory", "mode"), [("64MiB", "recompute"), ("96KiB", "recompute"), ("96KiB", "swap")])
def test_preemption_and_the_prefix_cache_keep_the_outputs(tiny_loaded, text_ids, kv_memory, mode, oracle):
    """The small cache preempts, by recompute or by swap (which copies exactly the blocks a sequence holds:
    none may be left over from a refused draft)."""
    prompts = _copying_prompts(text_ids, 12)
    params = [SamplingParams(max_tokens=20 + i % 9, temperature=0.0 if i % 4 else 0.8, seed=i, ignore_eos=True,
                             repetition_penalty=1.2 if i % 5 == 4 else 1.0) for i in range(12)]
    off = Engine(loaded=tiny_loaded, speculation="off", kv_memory=kv_memory, max_num_batched_tokens=64,
                 max_num_seqs=8, block_size=8)
    on = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory=kv_memory, max_num_batched_tokens=64,
                max_num_seqs=8, block_size=8, preemption_mode=mode)
    reference = off.generate(prompts, params)
    oracle(prompts, reference)
    expected = output_texts(reference)
    assert output_texts(on.generate(prompts, params)) == expected
    _spoke(on)
    if kv_memory == "96KiB":
        assert on.stats.preemptions > 0, "the small cache never preempted: the test lost its point"
    # every block the prefix cache names holds what its name says: a second run finds hits, same outputs
    cached = on.stats.prompt_tokens_cached
    assert output_texts(on.generate(prompts, params)) == expected
    if mode == "recompute":  # swapping, the small cache's free list turns over before the second run
        assert on.stats.prompt_tokens_cached > cached
    assert on.block_manager.num_free_blocks == on.block_manager.num_blocks  # nothing left held


def test_overlapped_steps_with_drafts_give_the_serial_engines_outputs(tiny_loaded, text_ids, oracle):
    prompts, params = _copying_prompts(text_ids, 6), draft_params(6)
    off = Engine(loaded=tiny_loaded, speculation="off", async_scheduling="off", kv_memory="64MiB")
    on = Engine(loaded=tiny_loaded, speculation="auto", async_scheduling="on", kv_memory="64MiB")
    reference = off.generate(prompts, params)
    oracle(prompts, reference)
    assert output_texts(on.generate(prompts, params)) == output_texts(reference)
    _spoke(on)


def test_a_checkpoint_holds_only_accepted_tokens_and_restores_elsewhere(tiny_loaded, text_ids, oracle):
    """Between steps, a request's state and named blocks hold accepted tokens only: restored in another
    engine (its named blocks loaded), it finishes with the text of an undisturbed run."""
    prompt = _copying_prompts(text_ids, 1)[0]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB", block_size=8).generate([prompt], params)
    whole = alone[0].completions[0].token_ids
    oracle([prompt], alone)
    engine = Engine(loaded=tiny_loaded, speculation="ngram:6", kv_memory="64MiB", block_size=8)
    engine.add_request(Request("r", prompt, params))
    for _ in range(6):
        engine.step()
    _spoke(engine)
    seq = engine.requests["r"].sequences[0]
    assert seq.draft == [] and seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == -(-seq.num_computed_tokens // 8)  # no block of a refused draft kept
    state = engine.request_state("r")
    (sample,) = state.samples
    out = sample.output_token_ids
    assert 6 < len(out) < 48 and out == whole[:len(out)]
    assert len(sample.block_hashes) == (len(prompt) + len(out) - 1) // 8
    data = engine.read_kv_blocks(sample.block_ids)
    other = Engine(loaded=tiny_loaded, speculation="ngram:6", kv_memory="64MiB", block_size=8)
    assert other.load_kv_blocks(sample.block_hashes, data) == len(sample.block_hashes)
    other.add_request(Request("r", prompt, params, resume_output_ids=[out]))
    done = []
    while other.has_unfinished():
        done += other.step()
    assert done[0].completions[0].token_ids == whole
    assert other.stats.prompt_tokens_cached == 8 * len(sample.block_hashes)


def test_auto_speculates_for_a_few_sequences_and_not_for_many(tiny_loaded, text_ids, oracle):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _copying_prompts(text_ids, 12)
    oracle(prompts, Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params))
    few = Engine(loaded=tiny_loaded, speculation="auto", speculation_max_running=4, kv_memory="64MiB")
    many = Engine(loaded=tiny_loaded, speculation="auto", speculation_max_running=4, kv_memory="64MiB")
    few.generate(prompts[:2], params)
    _spoke(few)
    metrics = WorkerMetrics()
    metrics.observe_step(few, 0.1)
    read = lambda name: metrics.registry.get_sample_value(name)  # noqa: E731
    assert read("berth_draft_tokens_total") == few.stats.draft_tokens
    assert read("berth_accepted_draft_tokens_total") == few.stats.accepted_tokens
    assert read("berth_draft_verifications_total") == few.stats.verifications > 0
    many.generate(prompts, params)  # 12 running, all to the end together: none drafts
    assert many.stats.draft_tokens == 0


def test_steps_with_drafts_keep_to_bucketed_row_counts(tiny_loaded, text_ids, oracle):
    """A step's rows are at most 8 or a multiple of 8 once drafts are in it (unless its drafts are too few to
    drop to one): on the CPU each new row count costs every linear layer a new oneDNN primitive."""
    prompts = _copying_prompts(text_ids, 11)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    oracle(prompts, Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params))
    engine = Engine(loaded=tiny_loaded, speculation="ngram:6", kv_memory="64MiB")
    rows, execute = [], engine.runner.execute

    def counted(step):
        rows.append((len(step.input_ids), sum(bool(s.draft) for s in engine.scheduler.running)))
        return execute(step)

    engine.runner.execute = counted
    assert output_texts(engine.generate(prompts, params)) == output_texts(
        Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params))
    _spoke(engine)
    with_drafts = [n for n, drafting in rows if drafting]
    assert with_drafts and all(n <= 8 or n % 8 == 0 for n in with_drafts), with_drafts


def test_seeded_samples_are_the_same_tokens_with_drafts(tiny_loaded, text_ids, oracle):
    """A seeded row is drawn at each verified position with that position's number (the sampler's), so a
    draft token is kept exactly when the draw without drafts would have chosen it: for a draft of one token a
    position that is rejection sampling (kept with probability p(x), the bonus token from the rest of p), and
    the text stays a function of the seed whatever shares the batch."""
    prompts = _copying_prompts(text_ids, 10)
    params = [SamplingParams(max_tokens=24, temperature=(0.6, 1.0, 1.3)[i % 3], seed=100 + i, top_k=(0, 40)[i % 2],
                             top_p=(1.0, 0.9)[i % 2 if i % 4 else 0], min_p=0.02 if i % 5 == 1 else 0.0,
                             logprobs=1 if i % 3 == 2 else None, n=2 if i == 4 else 1) for i in range(10)]
    off = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB")
    reference = off.generate(prompts, params)
    oracle(prompts, reference)
    on = Engine(loaded=tiny_loaded, speculation="ngram:4", kv_memory="64MiB")
    assert output_texts(on.generate(prompts, params)) == output_texts(reference)
    _spoke(on)
    # and alone: a request's text does not depend on what ran beside it
    alone = Engine(loaded=tiny_loaded, speculation="ngram:4", kv_memory="64MiB")
    assert output_texts(alone.generate(prompts[1:2], params[1:2])) == output_texts(reference[1:2])


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, smol_tokenizer):
    """A random model of 16 tokens (the default tokenizer's first 16 ids), its weights large enough that its
    distributions are far from uniform and it repeats itself: prompt lookup's drafts are kept now and then."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.models import save_tiny_model
    from worker.model.loader import load_model

    path = save_tiny_model(LlamaConfig, LlamaForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("small-vocab"),
                           vocab_size=16, tie_word_embeddings=False, initializer_range=0.3)
    import torch

    return load_model(str(path), torch.float32)


CHI2_15_AT_0001 = 37.70  # the chi-square distribution's upper 0.1% point, 15 degrees of freedom (16 tokens)


def test_sampled_tokens_keep_the_models_distribution_with_drafts(small_vocab):
    """Must-show 4: over many seeded draws at temperature 1, the tokens at each output position are drawn
    from the same distribution with drafts (ngram:3, verified by the engine's rejection rule) as without
    them, by a chi-square test of the two samples (different seeds, so the samples are independent); and a
    seeded request's text is the same in two runs. A verifier that kept drafts more often than the model
    would draw them (each draft kept, say) fails it: the prompt's continuation wins every position."""
    prompt, draws, length = [3, 4, 5, 6] * 6, 600, 8

    def sample(spec: str, seeds: range) -> tuple[list[list[int]], Engine]:
        engine = Engine(loaded=small_vocab, speculation=spec, kv_memory="64MiB")
        outputs = engine.generate([prompt] * len(seeds), [SamplingParams(max_tokens=length, temperature=1.0, seed=s,
                                                                         ignore_eos=True) for s in seeds])
        return [o.completions[0].token_ids for o in outputs], engine

    off, _ = sample("off", range(draws))
    on, engine = sample("ngram:3", range(draws, 2 * draws))
    _spoke(engine)
    assert engine.stats.acceptance_rate < 0.5  # drafts refused as well as kept: both ways of the rule ran
    for position in range(length):
        a = [0] * 16
        b = [0] * 16
        for tokens in off:
            a[tokens[position]] += 1
        for tokens in on:
            b[tokens[position]] += 1
        chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)  # two samples of equal size
        assert chi2 < CHI2_15_AT_0001, (position, chi2, a, b)
    again, _ = sample("ngram:3", range(draws, draws + 20))
    assert again == on[:20]


def _run(engine: Engine, requests: list[Request]) -> list:
    """Add ``requests`` and step until they are done; their outputs in their order."""
    for request in requests:
        engine.add_request(request)
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    return [done[request.request_id] for request in requests]


def _job_prompts(text_ids: list[int], shifted: bool = False) -> list[list[int]]:
    """A job's lines: passages of the same text; ``shifted``, each begins a token later (the same last tokens,
    another context: the model may go on otherwise, and the job's drafts are refused)."""
    return [text_ids[60 * i + shifted:60 * i + 30] for i in range(4)]


def _job_params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=(24, 16, 20, 24)[i % 4], temperature=0.0, ignore_eos=True,
                          logprobs=2 if i % 4 == 1 else None, n=2 if i % 4 == 2 else 1)


def _job_requests(prefix: str, prompts: list[list[int]], tenant: str = "t") -> list[Request]:
    return [Request(f"{prefix}{i}", p, _job_params(i), tenant=tenant, job="j") for i, p in enumerate(prompts)]


def test_a_jobs_earlier_outputs_draft_its_later_lines_and_the_outputs_stay_the_same(tiny_loaded, text_ids):
    """The tiny random model never repeats itself, so a sequence's own n-grams draft next to nothing; the
    job's earlier lines' outputs do (its suffix index, speculative/job_suffix.py). Its drafts are accepted,
    and refused where a line's context differs; greedy outputs are those without drafts."""
    waves = [_job_prompts(text_ids), _job_prompts(text_ids) + _job_prompts(text_ids, shifted=True)]
    off = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB")
    on = Engine(loaded=tiny_loaded, speculation="ngram:4", kv_memory="64MiB")
    for w, prompts in enumerate(waves):
        expected = output_texts(_run(off, _job_requests(f"{w}-", prompts)))
        assert output_texts(_run(on, _job_requests(f"{w}-", prompts))) == expected
        if w == 0:
            assert on.stats.job_draft_tokens == 0  # nothing of the job had finished: its index had no output
    _spoke(on)
    s = on.stats
    assert s.job_accepted_tokens > 0, "no draft of the job's index was accepted: the test lost its point"
    assert s.job_accepted_tokens < s.job_draft_tokens  # the shifted lines' drafts were refused, some of them
    assert s.job_accepted_tokens > (s.accepted_tokens - s.job_accepted_tokens)  # the job's index drafted most
    assert off.stats.draft_tokens == 0 and off.speculation.jobs is None  # off: nothing kept


def test_a_tenants_job_never_drafts_another_tenants_tokens(tiny_loaded, text_ids):
    """Two tenants, the same job id, the same prompts: tenant b's lines draft nothing from tenant a's outputs
    (which, the model greedy, would be accepted whole); a's later lines do draft from them."""
    prompts, engine = _job_prompts(text_ids), Engine(loaded=tiny_loaded, speculation="ngram:4", kv_memory="64MiB")

    def run(tenant: str, wave: int) -> list:
        return _run(engine, _job_requests(f"{tenant}{wave}-", prompts, tenant))

    first = output_texts(run("a", 0))
    proposals, propose = [], engine.speculation.jobs.propose

    def watched(tenant, job, tokens, k):
        proposal = propose(tenant, job, tokens, k)
        proposals.append((tenant, proposal.tokens))
        return proposal

    engine.speculation.jobs.propose = watched
    assert output_texts(run("b", 0)) == first
    assert proposals and {t for t, _ in proposals} == {"b"}
    assert engine.stats.job_draft_tokens == 0 and not any(tokens for _, tokens in proposals), proposals
    assert output_texts(run("a", 1)) == first
    assert engine.stats.job_accepted_tokens > 0, "tenant a's own job never drafted: the test lost its point"


def test_a_step_verifying_drafts_is_all_decode_rows(tiny_loaded, text_ids, oracle):
    """A draft's tokens are verified as decode rows (each over the cache up to itself), not as a prefill chunk
    per sequence: one decode-kernel call for the step, a CUDA graph's shape on a GPU; the outputs stay the same."""
    prompts = _copying_prompts(text_ids, 5)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params)
    oracle(prompts, reference)
    engine = Engine(loaded=tiny_loaded, speculation="ngram:4", kv_memory="64MiB")
    shapes, execute = [], engine.runner.execute

    def seen(step):
        drafting = sum(len(s.draft) for s in engine.scheduler.running)
        shapes.append((len(step.input_ids), step.num_decode, drafting))
        return execute(step)

    engine.runner.execute = seen
    assert output_texts(engine.generate(prompts, params)) == output_texts(reference)
    _spoke(engine)
    verifying = [(rows, decode) for rows, decode, drafting in shapes if drafting]
    assert verifying and all(rows == decode for rows, decode in verifying), verifying


def _penalised(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=28, temperature=0.0 if i % 3 else 0.9, seed=40 + i, ignore_eos=True,
                          repetition_penalty=(1.0, 1.6, 1.3)[i % 3], frequency_penalty=(0.9, 0.0, 0.4)[i % 3],
                          presence_penalty=(0.0, 0.6, 0.5)[i % 3], logprobs=1 if i % 4 == 1 else None)


def test_penalised_rows_count_the_draft_tokens_before_them(tiny_loaded, text_ids, oracle, monkeypatch):
    """A verified row's penalties count the draft tokens before it (``TokenCounts.extended``), as the plain
    decode step at that position would: greedy and seeded outputs are those without drafts. The penalties must
    matter here (outputs without them differ), and with rows that ignore the draft tokens the outputs differ."""
    prompts = _copying_prompts(text_ids, 9)
    params = [_penalised(i) for i in range(9)]
    reference = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params)
    unpenalised = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(
        prompts, [SamplingParams(max_tokens=28, temperature=p.temperature, seed=p.seed, ignore_eos=True)
                  for p in params])
    assert output_texts(unpenalised) != output_texts(reference), "the penalties changed nothing: no point"
    oracle(prompts, reference)
    on = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory="64MiB")
    assert output_texts(on.generate(prompts, params)) == output_texts(reference)
    _spoke(on)
    monkeypatch.setattr(TokenCounts, "extended", lambda self, tokens: self)  # rows blind to the drafts before them
    blind = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory="64MiB")
    assert output_texts(blind.generate(prompts, params)) != output_texts(reference)


def _constrained(i: int) -> SamplingParams:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}}, "required": ["name", "n"]}
    structured = (StructuredOutput("json_schema", json.dumps(schema)),
                  StructuredOutput("regex", "[a-z]{3,9}( [a-z]+)+"),
                  StructuredOutput("choice", json.dumps(["yes it is", "no it is not", "it depends on the day"])))[i % 3]
    return SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.8, seed=70 + i, structured=structured,
                          frequency_penalty=0.5 if i % 4 == 3 else 0.0, n=2 if i == 4 else 1)


def test_constrained_rows_mask_each_verified_position_and_the_matcher_rolls_back(tiny_loaded, text_ids, oracle,
                                                                                 monkeypatch):
    """A grammar's request drafts: the draft ends at the first token its grammar refuses (the oracle's wrong
    tokens and its tokens past the end are refused), each verified row is masked by the matcher past the draft
    tokens before it, and the matcher is rolled back to the sequence's own tokens. Outputs are those without
    drafts, greedy and seeded."""
    prompts = _copying_prompts(text_ids, 9)
    params = [_constrained(i) for i in range(9)]
    reference = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB").generate(prompts, params)
    oracle(prompts, reference)
    cuts, allowed = [], grammar.allowed_prefix

    def watched(matcher, tokens):
        n = allowed(matcher, tokens)
        cuts.append((n, len(tokens)))
        return n

    monkeypatch.setattr(grammar, "allowed_prefix", watched)
    on = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory="64MiB")
    assert output_texts(on.generate(prompts, params)) == output_texts(reference)
    _spoke(on)
    assert any(n < k for n, k in cuts) and any(n == k > 1 for n, k in cuts), cuts  # refused, and taken whole
    monkeypatch.setattr(grammar, "allowed_prefix", lambda matcher, tokens: len(tokens))  # drafts never cut
    uncut = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory="64MiB")
    assert output_texts(uncut.generate(prompts, params)) == output_texts(reference)  # the masks alone refuse them


def test_int8_kv_keeps_the_outputs_with_drafts(tiny_loaded, text_ids, oracle):
    """Verified rows write their keys and values to the int8 cache, as decode rows do, before attention reads
    them: the outputs are those of the int8 cache without drafts."""
    prompts, params = _copying_prompts(text_ids, 6), draft_params(6)
    off = Engine(loaded=tiny_loaded, speculation="off", kv_memory="64MiB", kv_cache_dtype="int8")
    reference = off.generate(prompts, params)
    oracle(prompts, reference)
    on = Engine(loaded=tiny_loaded, speculation="ngram:5", kv_memory="64MiB", kv_cache_dtype="int8")
    assert output_texts(on.generate(prompts, params)) == output_texts(reference)
    _spoke(on)


def test_a_stream_gets_several_tokens_a_step_and_its_pieces_add_up_to_the_result(smol_loaded, text_ids):
    """An interactive stream (the inbox's ``TextDelta``, fed after each step) takes a step's accepted tokens
    at once; its pieces add up to the result's text, where a stop string ended it too."""
    prompts = _copying_prompts(text_ids, 4)
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop=(" the",) if i % 2 else ()) for i in range(4)]
    engine = Engine(loaded=smol_loaded, speculation="ngram:4", kv_memory="64MiB")
    streams = {str(i): TextDelta(smol_loaded.tokenizer, p.stop) for i, p in enumerate(params)}
    pieces = {rid: [] for rid in streams}
    seen, most = dict.fromkeys(streams, 0), 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(Request(str(i), prompt, p))
    done = {}
    while engine.has_unfinished():
        finished = {out.request_id: out for out in engine.step()}
        for rid, request in engine.requests.items():
            out_ids = request.sequences[0].output_token_ids
            most, seen[rid] = max(most, len(out_ids) - seen[rid]), len(out_ids)
            pieces[rid].append(streams[rid].advance(out_ids))
        for rid, out in finished.items():
            pieces[rid].append(streams[rid].finish(out.completions[0].text))
            done[rid] = out
    _spoke(engine)
    assert most > 1, "no step gave a stream several tokens: the test lost its point"
    assert {rid: "".join(p) for rid, p in pieces.items()} == {rid: o.completions[0].text for rid, o in done.items()}
    assert any(o.completions[0].finish_reason == "stop" and params[int(rid)].stop for rid, o in done.items())
