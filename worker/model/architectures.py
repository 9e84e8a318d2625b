"""The decoder families berth runs, and the few facts that set each apart from plain Llama.

Llama, Mistral, Qwen2/2.5, Qwen3 and Phi-3 are one decoder (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU) with small differences: biases on some projections, a norm over
each head of q and k, projections the checkpoint stores fused, which layers attend over a sliding
window. One table says which, so the model (``worker.model.decoder``) is one class with switches and every
loader asks for exactly the Hugging Face tensors the model will use. A family is added here, in one
line, or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from worker.model.base import ModelLoadError


@dataclass(frozen=True)
class Architecture:
    qkv_bias: bool = False  # q, k and v projections carry biases
    o_bias: bool = False  # the attention output projection carries a bias
    mlp_bias: bool = False  # gate, up and down projections carry biases
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before rotary (Qwen3)
    fused_qkv: bool = False  # the checkpoint stores q, k, v as one self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint stores gate and up as one mlp.gate_up_proj (Phi-3)
    bias_flags: bool = False  # the config's attention_bias (q, k, v, o) and mlp_bias switch biases on
    window: str | None = None  # the config's sliding_window applies to "every" layer, or per "layer_types"


ARCHITECTURES: dict[str, Architecture] = {  # config.json's model_type -> its family's switches
    "llama": Architecture(bias_flags=True),
    "mistral": Architecture(window="every"),
    "qwen2": Architecture(qkv_bias=True, window="layer_types"),
    "qwen3": Architecture(qk_norm=True, bias_flags=True, window="layer_types"),
    "phi3": Architecture(fused_qkv=True, fused_gate_up=True, window="every"),
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
    """The longest sequence berth runs on this model: its whole context (``max_position_embeddings``).
    A sliding window does not shorten it: the layers that have one attend within it, as transformers'
    (Mistral v0.1 runs 32,768 tokens over a window of 4,096, Phi-3-mini-4k 4,096 over 2,047)."""
    return config.max_position_embeddings


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding attention window (``None``: full causal attention), as transformers' model
    of the family applies it:

    - Mistral and Phi-3: the config's ``sliding_window`` on every layer, where it is set (Mistral
      v0.1 has 4,096 and later Mistrals null; Phi-3-mini-4k has 2,047, the 128k models one longer
      than their context, which is no window: berth then runs full attention, the same numbers).
    - Qwen2 and Qwen3: on the layers ``layer_types`` calls ``"sliding_attention"``. Their config
      classes keep ``sliding_window`` only with ``use_sliding_window`` and, unless ``layer_types`` is
      given, make layers ``max_window_layers`` onwards the sliding ones; a config without
      ``layer_types`` (berth's own, from a GGUF file) has none.
    - Llama: no window; transformers' Llama ignores a ``sliding_window`` key.

    Known limit: the KV blocks a window has left behind stay allocated until the sequence ends
    (vLLM frees them), so a long sequence holds its whole context's blocks, as without a window.
    """
    arch = architecture(config)
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if arch.window is None or window is None or window >= config.max_position_embeddings:
        return [None] * layers
    if arch.window == "every":
        return [window] * layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def sliding_window(config) -> int | None:
    """The attention window if any layer has one (Mistral, Phi-3, Qwen with ``use_sliding_window``)."""
    return max((w for w in layer_windows(config) if w is not None), default=None)
