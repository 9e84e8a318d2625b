"""A Llama-family decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) that reads
and writes a paged KV cache.

One step is one flattened batch: the new tokens of every scheduled sequence, decode tokens first,
then prefill chunks, go through each linear layer as a single ``[tokens, hidden]`` matrix. Q, K and
V share one weight, as do the gate and up projections, so a layer is four matrix multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import AttentionOps
from worker.linear import Linear, make_linear


@dataclass
class StepInput:
    """What one forward pass needs, built once per step by the model runner."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefill + 1] int32, relative to row num_decode
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks] int32
    prefill_context_lens: torch.Tensor  # [num_prefill] int32
    logits_rows: torch.Tensor  # rows whose next-token logits are needed


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    def __init__(self, config, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 ops: AttentionOps):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError("Llama models with attention or MLP biases are not supported yet")
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = make_linear(self.embed if config.tie_word_embeddings else w.pop("lm_head.weight"))
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(Layer(
                input_norm=w[p + "input_layernorm.weight"],
                qkv=make_linear(torch.cat([w.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                o=make_linear(w.pop(p + "self_attn.o_proj.weight")),
                post_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=make_linear(torch.cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])),
                down=make_linear(w.pop(p + "mlp.down_proj.weight"))))
        # Rotary tables for every position, from transformers' own rotary module (rope scaling
        # variants included), in the same float32 arithmetic, cast to the model dtype.
        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rotary.attention_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * rotary.attention_scaling).to(device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states after the final norm for ``step.logits_rows``; writes every new token's K/V."""
        T = step.input_ids.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.cos[step.positions].unsqueeze(1)
        sin = self.sin[step.positions].unsqueeze(1)
        h = self.embed[step.input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer.input_norm, self.eps)
            q, k, v = layer.qkv(x).split([H * D, KVH * D, KVH * D], dim=-1)
            q = q.view(T, H, D)
            k = k.view(T, KVH, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.ops.write_kv(k, v.view(T, KVH, D), k_cache, v_cache, step.slot_mapping)
            attn = self._attention(q, k_cache, v_cache, step)
            h = h + layer.o(attn.view(T, H * D))
            x = rms_norm(h, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h[step.logits_rows], self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _attention(self, q, k_cache, v_cache, step: StepInput) -> torch.Tensor:
        nd = step.num_decode
        if nd == q.shape[0]:
            return self.ops.decode(q, k_cache, v_cache, step.decode_block_tables, step.decode_context_lens,
                                   self.scale)
        prefill = self.ops.prefill(q[nd:], k_cache, v_cache, step.prefill_block_tables,
                                   step.prefill_query_start_loc, step.prefill_context_lens, self.scale)
        if nd == 0:
            return prefill
        decode = self.ops.decode(q[:nd], k_cache, v_cache, step.decode_block_tables, step.decode_context_lens,
                                 self.scale)
        return torch.cat([decode, prefill])
