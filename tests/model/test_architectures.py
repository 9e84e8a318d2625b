"""Every architecture berth runs, against Hugging Face transformers.

For each family a tiny random model (2 layers, GQA 4:2) is built with transformers and saved as a
safetensors folder, each with what sets its family apart (llama3 rope scaling, biases, per-head q/k
norms, Phi-3's fused projections and partial rotary, a sliding window) and each stored differently
(sharded, bfloat16 and float16 on disk). Sixteen prompts of 1 to 600 tokens then run through the
engine with chunked prefill and the prefix cache: greedy tokens must be transformers', and float32
logits within 1e-3 of its forward pass.

The families with sliding windows get a second matrix with windows far shorter than the prompts
(Mistral's and Phi-3's on every layer, Qwen2's on the layers its ``layer_types`` names): chunks of
16 tokens, so each window spans several chunks, and decodes that run past the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.exactness import check_against_hf, make_prompts
from tests.support.models import cut_prompts, save_tiny_model
from worker.engine.engine import Engine
from worker.model.architectures import SUPPORTED_ARCHITECTURES, context_length, layer_windows
from worker.model.base import ModelLoadError
from worker.model.loader import load_config, load_model

NEW_TOKENS = 12
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 512}

# name -> (transformers' config and model class names, how the checkpoint is saved, config fields)
MODELS = {
    "llama3-tied-sharded": ("Llama", dict(max_shard_size="1MB", generation={"eos_token_id": [2, 5]}),
                            dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama2-untied-biases": ("Llama", {}, dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "mistral-window-bf16": ("Mistral", dict(disk_dtype=torch.bfloat16),
                            dict(tie_word_embeddings=False, sliding_window=1024)),
    "qwen2-biases-fp16": ("Qwen2", dict(disk_dtype=torch.float16),
                          dict(tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0})),
    "qwen3-qknorm-yarn": ("Qwen3", {}, dict(tie_word_embeddings=True, rope_parameters=YARN_ROPE)),
    # seed 0: seed 1234 puts two of this model's logits within 1e-6 of each other, a tie float noise breaks
    "phi3-fused-partial": ("Phi3", dict(seed=0), dict(tie_word_embeddings=False, pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}
# Windows short of the prompts, none of them a multiple of the 16-token blocks but Mistral's (48):
# name -> (family, how saved, config fields, the layer windows berth must read from the config)
WINDOWED = {
    "mistral-window48": ("Mistral", {}, dict(tie_word_embeddings=False, sliding_window=48), [48, 48]),
    "phi3-window37": ("Phi3", dict(seed=0), dict(tie_word_embeddings=False, pad_token_id=0, sliding_window=37,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5}), [37, 37]),
    # transformers makes layers max_window_layers onwards the sliding ones: layer 0 full, 1 and 2 windowed
    "qwen2-layer-windows": ("Qwen2", {}, dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=29,
                                              max_window_layers=1, num_hidden_layers=3), [None, 29, 29]),
}


def build(name: str, tokenizer, path: Path) -> Path:
    import transformers

    family, save, fields = MODELS[name] if name in MODELS else WINDOWED[name][:3]
    return save_tiny_model(getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM"),
                           tokenizer, path, random_vectors=True, **save, **fields)


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory, smol_tokenizer) -> Path:
    return build(request.param, smol_tokenizer, tmp_path_factory.mktemp(request.param))


def test_each_architecture_matches_transformers(model_dir, text_ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = Engine(loaded=load_model(str(model_dir), torch.float32), kv_memory="64MiB",
                    max_num_batched_tokens=96, block_size=16)
    prompts = make_prompts(text_ids)
    check_against_hf(hf, engine, prompts, generate_every=8, new_tokens=NEW_TOKENS)
    assert engine.stats.prompt_tokens_cached > 0, "the shared prefixes never hit the prefix cache"
    assert set(engine.eos_token_ids) >= set(hf.generation_config.eos_token_id
                                            if isinstance(hf.generation_config.eos_token_id, list)
                                            else [hf.generation_config.eos_token_id])


def test_the_checkpoints_are_stored_as_each_case_says(tmp_path, smol_tokenizer):
    """The fixtures hold what the matrix above claims: a sharded index, 16-bit files on disk, fused Phi-3
    names, Qwen2's biases, Qwen3's norms; and generation_config.json's extra EOS id reaches the engine."""
    from safetensors import safe_open

    def tensors(path):
        out = {}
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as h:
                out.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
        return out

    llama3 = build("llama3-tied-sharded", smol_tokenizer, tmp_path / "a")
    assert (llama3 / "model.safetensors.index.json").exists() and len(list(llama3.glob("*.safetensors"))) > 1
    assert 5 in Engine(loaded=load_model(str(llama3), torch.float32), kv_memory="8MiB").eos_token_ids
    assert set(tensors(build("mistral-window-bf16", smol_tokenizer, tmp_path / "b")).values()) == {"BF16"}
    qwen2 = tensors(build("qwen2-biases-fp16", smol_tokenizer, tmp_path / "c"))
    assert set(qwen2.values()) == {"F16"} and "model.layers.0.self_attn.k_proj.bias" in qwen2
    assert "model.layers.1.self_attn.q_norm.weight" in tensors(build("qwen3-qknorm-yarn", smol_tokenizer,
                                                                     tmp_path / "d"))
    phi3 = tensors(build("phi3-fused-partial", smol_tokenizer, tmp_path / "e"))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= phi3.keys()


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_windows_match_transformers(name, tmp_path, smol_tokenizer, text_ids):
    """Prompts of 30 to 200 tokens (two sharing a prefix, for the prefix cache) in chunks of 20
    tokens and 24 new tokens each, so every window spans chunks and every decode runs past a window
    (30 + 24 tokens pass the longest); greedy tokens and float32 logits as transformers' (sdpa, its
    default), whose eager attention gives the same logits. With the windows taken out of
    berth's layers its logits leave transformers': the comparison sees the windows."""
    from transformers import AutoModelForCausalLM

    path = build(name, smol_tokenizer, tmp_path)
    config = load_config(str(path))
    assert layer_windows(config) == WINDOWED[name][3]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(loaded=load_model(str(path), torch.float32), kv_memory="16MiB", max_num_batched_tokens=20,
                    block_size=16)
    assert [layer.window for layer in engine.runner.model.layers] == WINDOWED[name][3]
    base = cut_prompts(text_ids, [200], stride=4321)[0]
    prompts = cut_prompts(text_ids, [30, 49, 130]) + [base[:120], base]
    check_against_hf(hf, engine, prompts, generate_every=4, new_tokens=24)
    assert engine.stats.prompt_tokens_cached > 0, "the shared prefix never hit the prefix cache"

    long = torch.tensor([base])
    with torch.no_grad():
        sdpa = hf(long).logits[0]
        eager = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        torch.testing.assert_close(eager(long).logits[0], sdpa, atol=1e-4, rtol=0)
    for layer in engine.runner.model.layers:
        layer.window = None
    ours = _prompt_logits(engine, base)
    assert (ours - sdpa[-1]).abs().max() > 1e-2, "full attention gives transformers' logits: no window was tested"


def _prompt_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The engine's float32 logits of the token after ``prompt``."""
    from tests.support.exactness import run_capturing_logits
    from worker.engine.request import SamplingParams

    _, captured = run_capturing_logits(engine, [prompt], SamplingParams(max_tokens=1, temperature=0))
    return next(iter(captured.values()))


def test_a_sliding_window_does_not_cap_the_context(tmp_path, smol_tokenizer):
    """The front door and the engine take the model's whole context, not its window."""
    path = build("mistral-window-bf16", smol_tokenizer, tmp_path)
    config = load_config(str(path))
    assert layer_windows(config) == [1024, 1024]
    assert context_length(config) == 2048  # what the front door checks prompts against
    assert Engine(loaded=load_model(str(path), torch.float32), kv_memory="8MiB").max_model_len == 2048


def test_which_layers_have_a_window():
    """The configs transformers builds for each family, and the window each of its layers gets."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    shape = dict(num_hidden_layers=4, max_position_embeddings=4096)
    assert layer_windows(MistralConfig(num_hidden_layers=4, max_position_embeddings=32768)) == [4096] * 4  # v0.1
    assert layer_windows(MistralConfig(sliding_window=None, **shape)) == [None] * 4  # Mistral v0.2 on
    assert layer_windows(MistralConfig(sliding_window=2048, **shape)) == [2048] * 4
    assert layer_windows(Phi3Config(sliding_window=2047, **shape)) == [2047] * 4  # Phi-3-mini-4k
    assert layer_windows(Phi3Config(sliding_window=262144, **shape)) == [None] * 4  # past the context: no window
    assert layer_windows(Phi3Config(**shape)) == [None] * 4
    for qwen in (Qwen2Config, Qwen3Config):
        assert layer_windows(qwen(sliding_window=1024, **shape)) == [None] * 4  # no use_sliding_window
        assert layer_windows(qwen(use_sliding_window=True, sliding_window=1024, max_window_layers=3,
                                  **shape)) == [None, None, None, 1024]
        assert layer_windows(qwen(use_sliding_window=True, sliding_window=1024, **shape,
                                  layer_types=["sliding_attention", "full_attention"] * 2)) == [1024, None] * 2
    llama = LlamaConfig(**shape)
    llama.sliding_window = 1024  # a stray key in a config.json: transformers' Llama has no window
    assert layer_windows(llama) == [None] * 4


def _mapped_files() -> list[tuple[int, int, str]]:
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi, fields[5]))
    return spans


def _file_backed(tensor: torch.Tensor, folder: Path, spans) -> bool:
    ptr = tensor.data_ptr()
    return any(lo <= ptr < hi and name.startswith(str(folder)) for lo, hi, name in spans)


@pytest.mark.parametrize("name,dtype,mapped", [("llama2-untied-biases", torch.float32, True),
                                               ("mistral-window-bf16", torch.bfloat16, True),
                                               ("mistral-window-bf16", torch.float32, False)])
def test_weights_in_the_compute_dtype_are_the_files_pages(tmp_path, smol_tokenizer, name, dtype, mapped):
    """Memory-mapped and used where they lie when the file holds the compute dtype; converted otherwise."""
    from kernels.attention import select_ops
    from worker.model.decoder import DecoderModel

    path = build(name, smol_tokenizer, tmp_path)
    loaded = load_model(str(path), dtype)
    spans = _mapped_files()
    assert all(_file_backed(t, path, spans) == mapped for t in loaded.weights.values())
    model = DecoderModel(loaded.config, loaded.weights, dtype, torch.device("cpu"),
                         select_ops("torch", torch.device("cpu")))
    assert model.embed.data_ptr() == loaded.weights["model.embed_tokens.weight"].data_ptr()


def test_an_unsupported_architecture_is_refused_with_the_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ModelLoadError, match="'gpt2'") as error:
        load_model(str(tmp_path), torch.float32)
    assert all(arch in str(error.value) for arch in SUPPORTED_ARCHITECTURES)
    assert set(SUPPORTED_ARCHITECTURES) == {"llama", "mistral", "qwen2", "qwen3", "phi3"}
