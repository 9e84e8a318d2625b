"""Drafts from a draft model (``--speculative-model``, worker/engine/speculative/draft_model.py): outputs are the
engine's without drafts token for token, greedy or seeded, whatever the draft model (the target itself, which
drafts what the target writes, or another random model, whose drafts fail); the draft's cache keeps only accepted
tokens after each step; a draft model of another tokenizer is refused when the engine is built."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.drafts import draft_params, output_texts
from tests.support.models import cut_prompts, save_tiny_model
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams
from worker.engine.speculative.draft_model import TokenizerMismatch, check_same_tokenizer


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, smol_tokenizer):
    """Another random tiny Llama of the same tokenizer: its drafts are mostly refused."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here: at the module's top it imports triton before
    # tests/kernels can ask for its interpreter

    return save_tiny_model(LlamaConfig, LlamaForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("other-llama"),
                           tie_word_embeddings=False, rope_theta=10000.0, seed=4321)


def _engine(loaded, speculation: str, draft=None, **kw) -> Engine:
    return Engine(loaded=loaded, speculation=speculation, speculative_model=str(draft or ""), kv_memory="64MiB", **kw)


@pytest.mark.parametrize(("spec", "own"), [("draft:4", True), ("draft:3", False), ("auto", True)])
def test_greedy_outputs_are_the_same_with_a_draft_model(tiny_loaded, tiny_llama_dir, other_dir, text_ids, spec, own):
    """The target as its own draft model is accepted nearly always (only rows the target biases refuse it);
    another random model almost never; auto drafts with the model, prompt lookup finding nothing in text the
    tiny model never repeats."""
    prompts = cut_prompts(text_ids, [12, 40, 7, 25, 60, 18, 33, 9])
    params = draft_params(8)
    expected = output_texts(_engine(tiny_loaded, "off").generate(prompts, params))
    on = _engine(tiny_loaded, spec, tiny_llama_dir if own else other_dir)
    assert output_texts(on.generate(prompts, params)) == expected
    s = on.stats
    assert s.draft_tokens > 0, "the draft model drafted nothing: the test lost its point"
    if own:
        assert s.accepted_tokens > 0.8 * s.draft_tokens, (s.accepted_tokens, s.draft_tokens)
    else:
        assert s.accepted_tokens < 0.5 * s.draft_tokens, (s.accepted_tokens, s.draft_tokens)
    pool = on.speculation.draft_model.blocks
    assert pool.num_free_blocks == pool.num_blocks and not on.speculation.draft_model.shadows  # all given back


def test_the_draft_cache_keeps_only_accepted_tokens_after_each_step(tiny_loaded, other_dir, text_ids):
    """After every step a sequence's shadow holds a prefix of its tokens (never a refused draft token), in
    just the blocks those need; the other model's drafts are refused, so each step has something to roll back."""
    engine = _engine(tiny_loaded, "draft:6", other_dir, block_size=8)
    model = engine.speculation.draft_model
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(cut_prompts(text_ids, [20, 35, 11])):
        engine.add_request(Request(str(i), prompt, params))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            held = model.held_tokens(seq)
            if held is None:
                continue
            assert len(held) <= len(seq.token_ids) and held == seq.token_ids[:len(held)]
            shadow = model.shadows[seq.seq_id][1]
            assert len(shadow.block_table) == -(-len(held) // 8)
            checked += 1
    assert checked > 10 and engine.stats.draft_tokens > 2 * engine.stats.accepted_tokens
    assert model.blocks.num_free_blocks == model.blocks.num_blocks


def test_a_draft_model_of_another_tokenizer_is_refused_at_load(tiny_loaded, tiny_llama_dir, smol_tokenizer, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = tmp_path / "tokenizer"
    smol_tokenizer.save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    other = save_tiny_model(LlamaConfig, LlamaForCausalLM, tokenizer, tmp_path / "other", tie_word_embeddings=False)
    with pytest.raises(TokenizerMismatch) as caught:
        _engine(tiny_loaded, "draft:4", other)
    message = str(caught.value)
    assert str(other) in message and str(tiny_llama_dir) in message and "49154 tokens against 49152" in message


def test_the_tokenizer_check_compares_tokens_not_only_their_count():
    vocab = [f"t{i}" for i in range(1000)]

    def tokenizer(tokens):
        return SimpleNamespace(__len__=None, bos_token_id=1, eos_token_id=2, tokens=tokens,
                               convert_ids_to_tokens=lambda ids: [tokens[i] for i in ids])

    class Tok(SimpleNamespace):
        def __len__(self):
            return len(self.tokens)

    def model(tokens):
        return SimpleNamespace(tokenizer=Tok(**vars(tokenizer(tokens))))

    check_same_tokenizer(model(vocab), model(list(vocab)), "a", "b")
    swapped = list(vocab)
    swapped[999] = "other"
    with pytest.raises(TokenizerMismatch, match="token 999 is 'other' against 't999'"):
        check_same_tokenizer(model(swapped), model(vocab), "a", "b")


def test_seeded_samples_are_the_same_tokens_with_a_draft_model(tiny_loaded, tiny_llama_dir, text_ids):
    """A seeded row is drawn at each verified position with that position's number: a greedy draft is kept
    exactly where the draw without drafts chose it, so the text is the seed's whatever the draft model."""
    prompts = cut_prompts(text_ids, [15, 30, 8, 22, 41, 12])
    params = [SamplingParams(max_tokens=24, temperature=(0.3, 0.7, 1.0)[i % 3], seed=100 + i, top_k=(0, 40)[i % 2],
                             logprobs=1 if i % 3 == 2 else None, n=2 if i == 4 else 1) for i in range(6)]
    expected = output_texts(_engine(tiny_loaded, "off").generate(prompts, params))
    on = _engine(tiny_loaded, "draft:4", tiny_llama_dir)
    assert output_texts(on.generate(prompts, params)) == expected
    assert on.stats.accepted_tokens > 0 and on.stats.accepted_tokens < on.stats.draft_tokens


@pytest.mark.parametrize(("mode", "own", "overlap"), [("recompute", True, "off"), ("swap", False, "off"),
                                                      ("recompute", True, "on")])
def test_preemption_a_small_draft_pool_and_overlapped_steps_keep_the_outputs(tiny_loaded, tiny_llama_dir, other_dir,
                                                                             text_ids, mode, own, overlap):
    """A cache of a few blocks preempts (the shadows of preempted sequences are dropped), and the draft pool
    (a quarter of it) has no room for most sequences, which then decode without drafts: the outputs stay the
    same, greedy and seeded, and every draft block is given back at the end."""
    prompts = cut_prompts(text_ids, [20, 35, 11, 40, 28, 9, 50, 16, 33, 22, 14, 45])
    params = [SamplingParams(max_tokens=20 + i % 9, temperature=0.0 if i % 4 else 0.8, seed=i, ignore_eos=True)
              for i in range(12)]
    small = dict(kv_memory="96KiB", max_num_batched_tokens=64, max_num_seqs=8, block_size=8)
    expected = output_texts(Engine(loaded=tiny_loaded, speculation="off", **small).generate(prompts, params))
    on = Engine(loaded=tiny_loaded, speculation="draft:5", speculative_model=str(tiny_llama_dir if own else other_dir),
                preemption_mode=mode, async_scheduling=overlap, **small)
    assert output_texts(on.generate(prompts, params)) == expected
    assert on.stats.preemptions > 0 and on.stats.draft_tokens > 0, "the test lost its point"
    pool = on.speculation.draft_model.blocks
    assert pool.num_free_blocks == pool.num_blocks and not on.speculation.draft_model.shadows
