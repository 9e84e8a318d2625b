"""Write a random model of a real model's shape as a Hugging Face safetensors folder, for benchmarks
of a size that no model shipped on PyPI has (nothing is downloaded).

The default shape is Llama 3.2 1B's (1.24 billion parameters: 16 layers, hidden 2048, 32 query and
8 key/value heads, vocabulary 128,256, tied embeddings, ``llama3`` rope scaling), in bfloat16,
sharded in two files with an index as large checkpoints are. The tokenizer is the default model's
(its ids all lie inside the larger vocabulary). Random weights give random text: the benchmark's
requests ignore EOS and run to their lengths, so the work is a real model's work.

``--shape tiny`` writes a near-free model instead (one layer, hidden size 64, the default tokenizer's
vocabulary of 49,152): its forward costs next to nothing, so what a benchmark times around it is the
host's work (``benchmarks/job_path.py``).

    python benchmarks/random_model.py /tmp/llama3-1b          # then:
    python benchmarks/throughput.py --model /tmp/llama3-1b --dtype bfloat16 --requests 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from worker.config import default_model_path
from worker.model.tokenizer import load_tokenizer

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LLAMA_3_8B = {
    **LLAMA_3_2_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "head_dim": 128,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "rope_scaling": None,
}
"""Llama 3 8B's shape (8.03 billion parameters: 32 layers, hidden 4096, 32 query and 8 key/value heads)."""
TINY = {  # near-free: what is timed around its forward is the host's work
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False,
}
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B, "tiny": TINY}
STD = 0.02  # Llama's initializer_range


def layer_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, d, i = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    return {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (c["num_attention_heads"] * d, h),
            "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, h),
            "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, h),
            "self_attn.o_proj.weight": (h, c["num_attention_heads"] * d),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}


def random_tensor(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if len(shape) == 1:  # norm weights: ones, as a trained model's are near
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * STD).to(dtype)


def random_weights(config: dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> dict:
    """The model's tensors under their Hugging Face names, drawn where they are used (on a GPU, an 8B model
    in seconds, no disk). A layer's q/k/v and gate/up are row blocks of one tensor, as the decoder fuses
    them: it takes them as they lie, without a copy (``worker.model.decoder.adjacent_rows``)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(STD)

    h, d, i = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ones = torch.ones(h, dtype=dtype, device=device)
    weights = {"model.embed_tokens.weight": draw(config["vocab_size"], h), "model.norm.weight": ones}
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = draw(config["vocab_size"], h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        q, k, v = draw((heads + 2 * kv_heads) * d, h).split([heads * d, kv_heads * d, kv_heads * d])
        gate, up = draw(2 * i, h).chunk(2)
        weights.update({p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
                        p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": draw(h, heads * d),
                        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": draw(h, i)})
    return weights


def write(folder: Path, config: dict, dtype: torch.dtype, seed: int = 0, shards: int = 2) -> int:
    """Write the folder; return the number of parameters."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    names = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"]),
             "model.norm.weight": (config["hidden_size"],)}
    if not config["tie_word_embeddings"]:
        names["lm_head.weight"] = (config["vocab_size"], config["hidden_size"])
    for layer in range(config["num_hidden_layers"]):
        names.update({f"model.layers.{layer}.{n}": s for n, s in layer_shapes(config).items()})
    per_shard = -(-len(names) // shards)
    items = list(names.items())
    weight_map, params = {}, 0
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {name: random_tensor(shape, gen, dtype) for name, shape in items[k * per_shard:(k + 1) * per_shard]}
        params += sum(t.numel() for t in tensors.values())
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(int(torch.Size(s).numel()) * dtype.itemsize for s in names.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    tokenizer = load_tokenizer(default_model_path())
    (folder / "config.json").write_text(json.dumps({
        **config, "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}, indent=1))
    tokenizer.save_pretrained(str(folder))
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    args = parser.parse_args(argv)
    params = write(args.folder, SHAPES[args.shape], getattr(torch, args.dtype), args.seed)
    print(f"wrote {args.folder}: a random {args.shape}-shaped model, {params / 1e9:.4g}B parameters, {args.dtype}")


if __name__ == "__main__":
    main()
