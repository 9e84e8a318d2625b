"""The shape of a model read from a GGUF file, as the decoder reads it, without transformers.

Importing one of transformers' config classes costs over a second of every start (the module pulls
in transformers' activations, hub kernels and torch.distributed), and a worker restarted after a
crash pays it again. A GGUF file's header already holds every field, so ``gguf.loader`` fills this
instead, with the values transformers' config class of the family would hold (``rope_parameters``
normalised as transformers 5 does; ``tests/model/test_gguf_architectures.py`` compares the two field by
field). A Hugging Face folder keeps transformers' own config class (its config.json can say more
than this reads), but for a plain Llama (``safetensors_loader.plain_llama_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=dict)  # rope_type, rope_theta and the scaling's own
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def of(cls, model_type: str, *, rope_theta: float, rope_scaling: dict | None = None, **fields) -> ModelConfig:
        """The config transformers' class would make of these keyword arguments (those it is given
        by ``gguf.loader``): the head width defaults to hidden_size / heads, and the rope
        parameters gather the base, the scaling and a partial rotary factor."""
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        rope = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
        if fields.get("partial_rotary_factor") is not None:
            rope["partial_rotary_factor"] = fields["partial_rotary_factor"]
        if rope["rope_type"] == "longrope" and fields.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        return cls(model_type=model_type, rope_parameters=rope, **fields)
