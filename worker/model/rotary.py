"""Rotary position tables (cos and sin for every position) from a config's ``rope_parameters``.

Computed here rather than by transformers' rotary modules so that loading a model never imports
transformers' modeling code (seconds of start-up). The arithmetic follows transformers' own
(``modeling_rope_utils``) step for step, in float32, so the tables agree with it bit for bit; the
tests hold them to that.

Every rope type but ``longrope`` is one fixed table. ``longrope`` (Phi-3's long-context models) has
two sets of frequencies, short and long: transformers rotates a sequence with the short set while
it is at most ``original_max_position_embeddings`` tokens long, and once it is longer, with the long
set, all of it: Phi-3's generate drops its cache when a sequence first passes that length and
computes every key again. berth keeps both tables, one after the other, and does the same: a
sequence whose tokens outnumber the threshold (``long_rope``) reads the long table, and one that
passes it while generating is computed again, whole (``Engine._rotate_long``). Its KV blocks then
hash from another root (``worker.engine.block_manager.hash_root``): they hold other keys than a short
sequence's blocks of the same tokens. ``dynamic`` changes its frequencies with every length, which
a KV cache cannot follow: it is refused with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from worker.model.base import ModelLoadError

RopeFn = Callable[[dict, int, int], "tuple[torch.Tensor, float]"]


def _base_inv_freq(rope: dict, dim: int) -> torch.Tensor:
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope, dim), 1.0


def _linear(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope, dim) / rope["factor"], 1.0


def _llama3(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq = _base_inv_freq(rope, dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's and Qwen3's long-context setting): interpolated and extrapolated frequencies
    blended by a ramp over the dimensions, and cos/sin scaled by an attention factor."""
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _longrope(rope: dict, dim: int, max_positions: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's long-context models): the base frequencies divided by a factor per
    dimension, ``short_factor`` or ``long_factor``, and cos/sin scaled by an attention factor derived
    from how far the context was stretched."""
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention


ROPE_TYPES: dict[str, RopeFn] = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn,
                                 "longrope": _longrope}


def rope_parameters(config) -> dict:
    rope = getattr(config, "rope_parameters", None)
    if not rope or "rope_theta" not in rope:
        raise ModelLoadError(f"the {config.model_type} config has no rope_parameters with a rope_theta: read it with "
                         "transformers>=5's config class, which fills them in from rope_theta and rope_scaling")
    return rope


def rotary_dim(config, head_dim: int) -> int:
    """How many of each head's dimensions are rotated (all, unless ``partial_rotary_factor`` < 1)."""
    return int(head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0))


def inv_freq_and_scaling(config, head_dim: int) -> tuple[torch.Tensor, float]:
    rope = rope_parameters(config)
    kind = rope.get("rope_type", "default")
    fn = ROPE_TYPES.get(kind)
    if fn is None:
        why = (" (its frequencies change with each sequence's length, which a KV cache cannot follow)"
               if kind == "dynamic" else "")
        raise ModelLoadError(f"rope type {kind!r} of this {config.model_type} model is not supported{why}; berth "
                         f"runs {sorted(ROPE_TYPES)}")
    return fn(rope, rotary_dim(config, head_dim), config.max_position_embeddings)


def long_rope_from(config) -> int | None:
    """For a ``longrope`` model, the length past which transformers rotates with the long factors
    (``original_max_position_embeddings``); None for every other model."""
    rope = rope_parameters(config)
    return rope["original_max_position_embeddings"] if rope.get("rope_type") == "longrope" else None


def long_rope(threshold: int | None, num_tokens: int) -> bool:
    """Whether a sequence of ``num_tokens`` tokens is rotated with the long factors (see above)."""
    return threshold is not None and num_tokens > threshold


def long_table_row(config) -> int:
    """Where a ``longrope`` model's long table starts in its rotary tables: a token of position ``p``
    rotated with the long factors reads row ``p + long_table_row(config)``."""
    return config.max_position_embeddings


def rotary_tables(config, head_dim: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[max_position_embeddings, rotary_dim]``, in the model dtype; for a
    ``longrope`` model twice as many rows: the short table, then the long one (``long_table_row``)."""
    positions = torch.arange(long_table_row(config), dtype=torch.float32)
    tables = [inv_freq_and_scaling(config, head_dim)]
    if long_rope_from(config) is not None:
        tables.append(_longrope(rope_parameters(config), rotary_dim(config, head_dim),
                                config.max_position_embeddings, long=True))
    cos, sin = [], []
    for inv_freq, scaling in tables:
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos.append(emb.cos() * scaling)
        sin.append(emb.sin() * scaling)
    return torch.cat(cos).to(device=device, dtype=dtype), torch.cat(sin).to(device=device, dtype=dtype)
