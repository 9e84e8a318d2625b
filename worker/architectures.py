"""The decoder families berth runs, and the few facts that set each apart from plain Llama.

Llama, Mistral, Qwen2/2.5, Qwen3 and Phi-3 are one decoder (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU) with small differences: biases on some projections, a norm over
each head of q and k, projections the checkpoint stores fused. One table says which, so the model
(``worker.model``) is one class with switches and every loader asks for exactly the Hugging Face
tensors the model will use. A family is added here, in one line, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class ModelLoadError(RuntimeError):
    """The model path is not a model berth can load; the message says why and what to do.

    Defined here, the leaf every loading module imports, and used as ``worker.model_loader.ModelLoadError``.
    """


@dataclass(frozen=True)
class Architecture:
    qkv_bias: bool = False  # q, k and v projections carry biases
    o_bias: bool = False  # the attention output projection carries a bias
    mlp_bias: bool = False  # gate, up and down projections carry biases
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before rotary (Qwen3)
    fused_qkv: bool = False  # the checkpoint stores q, k, v as one self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint stores gate and up as one mlp.gate_up_proj (Phi-3)
    bias_flags: bool = False  # the config's attention_bias (q, k, v, o) and mlp_bias switch biases on


ARCHITECTURES: dict[str, Architecture] = {  # config.json's model_type -> its family's switches
    "llama": Architecture(bias_flags=True),
    "mistral": Architecture(),
    "qwen2": Architecture(qkv_bias=True),
    "qwen3": Architecture(qk_norm=True, bias_flags=True),
    "phi3": Architecture(fused_qkv=True, fused_gate_up=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def check_supported(model_type, where: str) -> None:
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"{where} is a {model_type!r} model; berth runs the architectures "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}: pick a model of one of those")


def architecture(config) -> Architecture:
    """The switches of this model: its family's, with the config's bias flags applied where they count."""
    check_supported(config.model_type, "the model")
    arch = ARCHITECTURES[config.model_type]
    if not arch.bias_flags:
        return arch
    attention = bool(getattr(config, "attention_bias", False))
    return replace(arch, qkv_bias=arch.qkv_bias or attention, o_bias=arch.o_bias or attention,
                   mlp_bias=arch.mlp_bias or bool(getattr(config, "mlp_bias", False)))


def qkv_modules(arch: Architecture) -> list[str]:
    """The checkpoint's modules that make the one q/k/v projection, in that order."""
    return ["self_attn.qkv_proj"] if arch.fused_qkv else [f"self_attn.{n}_proj" for n in "qkv"]


def gate_up_modules(arch: Architecture) -> list[str]:
    """The checkpoint's modules that make the one gate/up projection, gate first."""
    return ["mlp.gate_up_proj"] if arch.fused_gate_up else ["mlp.gate_proj", "mlp.up_proj"]


def layer_weight_names(arch: Architecture) -> list[str]:
    def linear(modules: list[str], bias: bool) -> list[str]:
        return [m + ".weight" for m in modules] + [m + ".bias" for m in modules] * bias

    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += linear(qkv_modules(arch), arch.qkv_bias) + linear(["self_attn.o_proj"], arch.o_bias)
    names += linear(gate_up_modules(arch), arch.mlp_bias) + linear(["mlp.down_proj"], arch.mlp_bias)
    return names + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] * arch.qk_norm


def hf_weight_names(config) -> list[str]:
    """The names of every tensor the model reads, as in the family's Hugging Face checkpoint."""
    arch = architecture(config)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    layer = layer_weight_names(arch)
    return names + [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in layer]


def context_length(config) -> int:
    """The longest sequence berth runs on this model: its context, capped at its attention window if it
    has one. berth's attention has no window; within the window, the window masks nothing, so full
    attention computes exactly what the model would (Mistral v0.1 runs 4,096 tokens, Phi-3-mini-4k 2,047)."""
    window = sliding_window(config)
    return min(config.max_position_embeddings, window) if window else config.max_position_embeddings


def sliding_window(config) -> int | None:
    """The attention window if any layer has one (Mistral, Phi-3, Qwen with ``use_sliding_window``)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window
