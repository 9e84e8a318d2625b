"""The decoder of every family berth runs (Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3): RMSNorm, rotary
embeddings, grouped-query attention and SwiGLU, with the few switches of ``worker.model.architectures``
(biases, per-head q/k norms, partial rotary, per-layer sliding windows), reading and writing a
paged KV cache.

One step is one flattened batch: the new tokens of every scheduled sequence, decode tokens first,
then prefill chunks, go through each linear layer as a single ``[tokens, hidden]`` matrix. Q, K and
V share one weight, as do the gate and up projections, so a layer is four matrix multiplies,
whether the checkpoint stores them fused (Phi-3) or apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import kv_quant
from kernels.attention import AttentionOps
from kernels.cpu_elementwise import ElementwiseKernel
from worker.model.architectures import architecture, gate_up_modules, layer_windows, qkv_modules
from worker.model.base import ModelLoadError
from worker.model.linear import Linear, make_int8_linear, make_linear
from worker.model.rotary import rotary_tables


@dataclass
class StepInput:
    """What one forward pass needs, built once per step by the model runner."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 rows of the rotary tables: the position (+ the table's length: long rope)
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int  # rows [0, num_decode) are single-token queries
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefill + 1] int32, relative to row num_decode
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks] int32
    prefill_context_lens: torch.Tensor  # [num_prefill] int32
    logits_rows: torch.Tensor  # rows whose hidden states are wanted: those needing logits, then the pooled ones
    num_pooled: int = 0  # the last rows of logits_rows are pooled into embeddings, not turned into logits
    # (rows of input_ids, rows of the previous step's sampled tokens): inputs a step still in flight samples,
    # copied on the device before the forward (an overlapped step's decodes); None when there are none
    from_previous: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear
    q_norm: torch.Tensor | None = None  # [head_dim], over each head (Qwen3)
    k_norm: torch.Tensor | None = None
    window: int | None = None  # sliding attention window (worker.model.architectures.layer_windows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of each head (all of them, but for partial rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., dim:]), dim=-1)


QUANTIZE_LM_HEAD = False
"""With int8 weights, the LM head stays in the model's dtype: it is the largest single matrix and the one
nearest the logits (benchmarks/int8_weights.py measures it quantized too, by setting this)."""


def _projection(w: dict[str, torch.Tensor], prefix: str, modules: list[str], bias: bool, int8: bool) -> Linear:
    """One linear for the checkpoint's ``modules`` that the step runs together: a fused tensor used
    as it lies (Phi-3's), the parts viewed as one where they lie back to back in memory (as the GGUF
    weights cache writes them), or else concatenated (the one copy fusing costs)."""
    def joined(kind: str) -> torch.Tensor:
        tensors = [w.pop(f"{prefix}{m}.{kind}") for m in modules]
        if len(tensors) == 1:
            return tensors[0]
        view = adjacent_rows(tensors)
        return torch.cat(tensors) if view is None else view

    return (make_int8_linear if int8 else make_linear)(joined("weight"), joined("bias") if bias else None)


def adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(tensors)`` as a view, without a copy, where each tensor is contiguous and starts in
    the same storage where the one before ends; None where they do not."""
    first = tensors[0]
    storage, end = first.untyped_storage(), first.data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous() or t.data_ptr() != end
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        end += t.numel() * t.element_size()
    if end > storage.data_ptr() + storage.nbytes():
        return None
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


class DecoderModel:
    def __init__(self, config, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 ops: AttentionOps, int8_weights: bool = False, elementwise: ElementwiseKernel | None = None):
        """``weights`` under the Hugging Face checkpoint's names and shapes (``hf_weight_names``);
        ``int8_weights``: the attention and MLP projections multiply by int8 weights (not bit-exact);
        ``elementwise``: the C kernel of the residual adds, norms, rotary and KV writes, used in float32 and
        bfloat16 on the CPU where no per-head q/k norm comes between the projection and rotary (else
        PyTorch's ops)."""
        arch = architecture(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"this {config.model_type} model's activation is {config.hidden_act!r}; berth's "
                                 "MLP is SwiGLU (silu)")
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}  # no copy if already there
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        head = self.embed if config.tie_word_embeddings else w.pop("lm_head.weight")  # the embedding stays float
        self.lm_head = (make_int8_linear if int8_weights and QUANTIZE_LM_HEAD else make_linear)(head)
        self.layers = []
        windows = layer_windows(config)
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(Layer(
                input_norm=w[p + "input_layernorm.weight"],
                qkv=_projection(w, p, qkv_modules(arch), arch.qkv_bias, int8_weights),
                o=_projection(w, p, ["self_attn.o_proj"], arch.o_bias, int8_weights),
                post_norm=w[p + "post_attention_layernorm.weight"],
                gate_up=_projection(w, p, gate_up_modules(arch), arch.mlp_bias, int8_weights),
                down=_projection(w, p, ["mlp.down_proj"], arch.mlp_bias, int8_weights),
                q_norm=w[p + "self_attn.q_norm.weight"] if arch.qk_norm else None,
                k_norm=w[p + "self_attn.k_norm.weight"] if arch.qk_norm else None,
                window=windows[i]))
        self.cos, self.sin = rotary_tables(config, self.head_dim, device, dtype)  # [positions, rotary dim]
        self.cos, self.sin = self.cos.contiguous(), self.sin.contiguous()
        self.fused = (elementwise if elementwise is not None and not arch.qk_norm and elementwise.takes(self.cos)
                      else None)

    @torch.inference_mode()
    def forward(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states after the final norm for ``step.logits_rows`` (what transformers' ``AutoModel``
        gives as ``last_hidden_state``); writes every new token's K/V."""
        if self.fused is not None and self.fused.takes(self.embed):
            return self._forward_fused(step, kv_caches)
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
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, self.eps)
                k = rms_norm(k, layer.k_norm, self.eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            v = v.view(T, KVH, D)
            self.ops.write_kv(k, v, k_cache, v_cache, step.slot_mapping)
            attn = self._attention(q, k_cache, v_cache, step, layer.window, k, v)
            h = h + layer.o(attn.view(T, H * D))
            x = rms_norm(h, layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate).mul_(up))
        return rms_norm(h[step.logits_rows], self.norm, self.eps)

    def _forward_fused(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``forward`` with each residual add and norm, and rotary with the KV write, one pass of the C
        kernel (``kernels.cpu_elementwise``); the residual stream ``h`` is added to in place."""
        T = step.input_ids.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.embed[step.input_ids]  # a new tensor: the residual stream, owned by this step
        delta = None  # what the layer before adds to h
        writes_cache = self.fused.writes_cache(h.dtype, *kv_caches[0])
        own_rows = step.num_decode < T and self.ops.prefill_reads_own_rows
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self.fused.add_rms_norm(h, delta, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            # rotary writes a cache of the model's dtype itself; the rotated keys are kept for a step's prefill chunks
            # where the backend's prefill reads them from the step (not the cache), and for the backend to
            # write any other cache (int8: quantized) from
            keys = torch.empty(T, KVH, D, dtype=qkv.dtype) if own_rows or not writes_cache else None
            cache = (k_cache, v_cache, step.slot_mapping) if writes_cache else (None, None, None)
            q = self.fused.rotary_kv(qkv, step.positions, self.cos, self.sin, H, KVH, D, *cache, keys)
            values = None if keys is None else qkv[:, (H + KVH) * D:].view(T, KVH, D)
            if not writes_cache:
                self.ops.write_kv(keys, values, k_cache, v_cache, step.slot_mapping)
            attn = self._attention(q, k_cache, v_cache, step, layer.window, keys, values)
            x = self.fused.add_rms_norm(h, layer.o(attn.view(T, H * D)), layer.post_norm, self.eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            delta = layer.down(F.silu(gate).mul_(up))
        h += delta
        return rms_norm(h[step.logits_rows], self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _attention(self, q, k_cache, v_cache, step: StepInput, window: int | None, key: torch.Tensor | None = None,
                   value: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows over the cache; prefill chunks over the cache before them and, where the step's
        own ``key``/``value`` are given, over those (``kernels.reference.paged_prefill_attention``)."""
        nd = step.num_decode
        if nd == q.shape[0]:
            return self.ops.decode(q, k_cache, v_cache, step.decode_block_tables, step.decode_context_lens,
                                   self.scale, window)
        # the chunks' own rows as the cache holds them: a quantized cache's rounded, for the whole step at once
        own = {}
        if key is not None and self.ops.prefill_reads_own_rows:
            fmt = kv_quant.row_format(k_cache)
            own = {"key": key[nd:], "value": value[nd:]} if fmt is None else {
                name: kv_quant.dequantize(kv_quant.quantize(rows[nd:], fmt.name), q.dtype)
                for name, rows in (("key", key), ("value", value))}
        prefill = self.ops.prefill(q[nd:], k_cache, v_cache, step.prefill_block_tables,
                                   step.prefill_query_start_loc, step.prefill_context_lens, self.scale, window, **own)
        if nd == 0:
            return prefill
        decode = self.ops.decode(q[:nd], k_cache, v_cache, step.decode_block_tables, step.decode_context_lens,
                                 self.scale, window)
        return torch.cat([decode, prefill])
