"""Embeddings requests in the engine, against Hugging Face transformers.

Sixteen inputs of 1 to 300 tokens (the longer ones chunked over several steps, two sharing a long
prefix) run in one engine beside four greedy generations: each vector must be transformers'
``AutoModel(...).last_hidden_state`` pooled as the model asks (the last token for a tiny random Qwen3
whose sentence-transformers files say ``pooling_mode_lasttoken``, the mean for the default model
and for a tiny Qwen3 that says ``pooling_mode_mean_tokens``) and L2-normalised, within 1e-4; the
generations' tokens must be those of a run without the embeddings. The mean-pooled tiny model runs
in a KV cache too small for the whole batch, so inputs and generations are preempted and
recomputed on the way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.models import cut_prompts, save_tiny_model
from worker.engine.engine import Engine, RequestRejected
from worker.engine.request import EmbeddingParams, Request, SamplingParams
from worker.model.base import ModelLoadError
from worker.model.loader import load_model
from worker.model.pooling_config import model_pooling

LENGTHS = [1, 2, 3, 5, 16, 17, 31, 48, 64, 80, 100, 129, 150, 200, 257, 300]
GROUPS = [1, 5, 10]  # the 16 inputs as three requests: one input, then lists of 5 and 10


def write_pooling(folder: Path, mode: str) -> Path:
    """sentence-transformers' files for ``pooling_mode_<mode>`` (a Transformer, a Pooling, a Normalize module)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens",
                                                       "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    return folder


def tiny_qwen3(path: Path, tokenizer, mode: str) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    save_tiny_model(Qwen3Config, Qwen3ForCausalLM, tokenizer, path, random_vectors=True, tie_word_embeddings=True)
    return write_pooling(path, mode)


def embedding_inputs(text_ids) -> list[list[int]]:
    inputs = cut_prompts(text_ids, LENGTHS)
    inputs[14] = inputs[15][:257]  # a long shared prefix: the prefix cache may serve it (last-token pooling)
    return inputs


def embedding_requests(inputs: list[list[int]], dimensions: int | None = None) -> list[Request]:
    requests, at = [], 0
    for g, size in enumerate(GROUPS):
        group = inputs[at:at + size]
        at += size
        params = SamplingParams(max_tokens=1, embedding=EmbeddingParams(tuple(map(len, group)), dimensions))
        requests.append(Request(f"e{g}", [t for ids in group for t in ids], params))
    return requests


def generation_requests(text_ids) -> list[Request]:
    prompts = cut_prompts(text_ids, [40, 90, 7, 150], stride=3001)
    return [Request(f"g{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]


def run(engine: Engine, requests: list[Request]) -> dict:
    for r in requests:
        engine.add_request(r)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id] = out
    return outputs


def hf_vectors(hf, inputs: list[list[int]], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        rows = []
        for ids in inputs:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            rows.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return F.normalize(torch.stack(rows), dim=-1)


def check_beside_generation(engine: Engine, hf, text_ids, pooling: str) -> None:
    inputs = embedding_inputs(text_ids)
    alone = run(engine, generation_requests(text_ids))
    both = run(engine, generation_requests(text_ids) + embedding_requests(inputs))
    for rid, out in alone.items():
        assert both[rid].completions[0].token_ids == out.completions[0].token_ids, rid
    ours = torch.cat([torch.from_numpy(both[f"e{g}"].embeddings) for g in range(len(GROUPS))])
    assert ours.shape == (16, engine.hidden_size)
    want = hf_vectors(hf, inputs, pooling)
    assert (ours - want).abs().max().item() < 1e-4
    assert F.cosine_similarity(ours, want).min().item() > 0.99999
    assert [len(both[f"e{g}"].prompt_token_ids) for g in range(3)] == [
        sum(map(len, inputs[:1])), sum(map(len, inputs[1:6])), sum(map(len, inputs[6:]))]
    assert engine.block_manager.num_used_blocks == 0  # no KV kept once they ended


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3-last"), smol_tokenizer, "lasttoken")


def test_last_token_pooling_matches_transformers_beside_generation(qwen3_last, text_ids):
    from transformers import AutoModel

    assert model_pooling(qwen3_last) == "last"
    engine = Engine(loaded=load_model(str(qwen3_last), torch.float32), kv_memory="64MiB", max_num_batched_tokens=96,
                    dtype="float32", threads=1)
    hf = AutoModel.from_pretrained(str(qwen3_last), dtype=torch.float32).eval()
    check_beside_generation(engine, hf, text_ids, "last")
    assert engine.stats.prompt_tokens_cached > 0  # the shared prefix was taken from the cache


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mean_pooling_matches_transformers_through_preemptions(tmp_path, smol_tokenizer, text_ids, mode):
    from transformers import AutoModel

    folder = tiny_qwen3(tmp_path, smol_tokenizer, "mean_tokens")
    assert model_pooling(folder) == "mean"
    # 26 blocks of 16 tokens (8 KiB each): less than the batch needs at once
    engine = Engine(loaded=load_model(str(folder), torch.float32), kv_memory=26 * 8192, max_num_batched_tokens=64,
                    dtype="float32", threads=1, preemption_mode=mode)
    midway, preempt = [], engine.scheduler._preempt  # embeddings inputs preempted part-way through their prefill

    def spy(seq, step):
        if seq.request.params.embedding is not None and 0 < seq.num_computed_tokens < seq.num_tokens:
            midway.append(seq.num_computed_tokens)
        return preempt(seq, step)

    engine.scheduler._preempt = spy
    hf = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    check_beside_generation(engine, hf, text_ids, "mean")
    assert midway


@pytest.mark.slow
def test_the_default_model_mean_pools_as_transformers(smol_loaded, hf_smol, text_ids):
    engine = Engine(loaded=smol_loaded, kv_memory="64MiB", max_num_batched_tokens=256, dtype="float32", threads=1)
    check_beside_generation(engine, hf_smol.model, text_ids, "mean")  # the causal LM's body: AutoModel's


def test_dimensions_cut_then_normalise_and_bounds_are_refused(qwen3_last, text_ids):
    engine = Engine(loaded=load_model(str(qwen3_last), torch.float32), kv_memory="64MiB", dtype="float32", threads=1)
    inputs = embedding_inputs(text_ids)
    full = run(engine, embedding_requests(inputs))
    cut = run(engine, embedding_requests(inputs, dimensions=8))
    for g in range(len(GROUPS)):
        assert torch.allclose(torch.from_numpy(cut[f"e{g}"].embeddings),
                              F.normalize(torch.from_numpy(full[f"e{g}"].embeddings[:, :8]), dim=-1),
                              atol=1e-6)
    too_wide = SamplingParams(max_tokens=1, embedding=EmbeddingParams((3,), dimensions=65))
    with pytest.raises(RequestRejected, match="dimensions 65 exceeds the model's hidden size 64"):
        engine.add_request(Request("w", [1, 2, 3], too_wide))
    too_long = SamplingParams(max_tokens=1, embedding=EmbeddingParams((3, 3000)))
    with pytest.raises(RequestRejected, match="an input of 3000 tokens exceeds the model's context"):
        engine.add_request(Request("l", [1] * 3003, too_long))
    with pytest.raises(ValueError, match="lengths add up to 4 tokens, the prompt has 3"):
        Request("x", [1, 2, 3], SamplingParams(embedding=EmbeddingParams((2, 2))))


def test_a_pooling_mode_berth_lacks_is_refused_naming_the_file(tmp_path):
    write_pooling(tmp_path, "max_tokens")
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config.json: pooling modes \['pooling_mode_max_tokens'\]"):
        model_pooling(tmp_path)
    (tmp_path / "modules.json").write_text("[{")
    with pytest.raises(ModelLoadError, match="modules.json, line 1: not valid JSON"):
        model_pooling(tmp_path)
    (tmp_path / "modules.json").unlink()
    assert model_pooling(tmp_path) == "mean"  # no sentence-transformers files: the mean
