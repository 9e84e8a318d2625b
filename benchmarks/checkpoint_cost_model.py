"""The checkpoint cost model of docs/checkpoints.md as numbers: PUTs/s, bytes/s and $/day per worker,
before segments (a state object per request every interval, every full KV block its own object) and
after (a segment a round, KV in runs of 8 and only where ``KvPolicy`` finds it pays), for the default
model (its shape read from its GGUF file) and a Llama-3-8B-shaped model on a GPU.

    python benchmarks/checkpoint_cost_model.py          # the markdown table docs/checkpoints.md shows

Sizes of states and segments are those of the real encoders (``format.encode_segment``) for states of
the row's mean context; the KV decision is the worker's own (``KvPolicy.worth_writing``) at the rates
the row assumes, taken for a request as it starts (its whole prompt computed, all its output to go).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from worker.checkpoint.costs import KvPolicy, TransferRates
from worker.checkpoint.format import RUN_BLOCKS, RequestCheckpoint, SampleCheckpoint, encode_segment
from worker.config import default_model_path

PUT_DOLLARS = 0.005 / 1000  # S3 standard, per PUT (list price)
DAY = 86_400


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Row:
    shape: Shape
    where: str
    running: int  # R: requests decoding at once
    tokens_per_second: float  # r: per request (a step makes one token for each)
    prompt: int  # P tokens
    output: int  # N tokens
    rates: TransferRates  # prefill, store read/write bandwidth, cost of a PUT


def smollm2_shape(dtype_bytes: int = 4) -> Shape:
    from worker.model.gguf.loader import load_gguf_config

    c = load_gguf_config(default_model_path())
    return Shape("SmolLM2-135M", c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype_bytes)


LLAMA3_8B = Shape("Llama-3-8B shape", 32, 8, 128, 2)


def _state(prompt: int, generated: int, block_size: int) -> RequestCheckpoint:
    """A state of a request with ``generated`` tokens so far, as the checkpointer makes it."""
    blocks = (prompt + generated - 1) // block_size
    return RequestCheckpoint("1234567", "f" * 32, "d" * 32, prompt,
                             [SampleCheckpoint(0, [40_000] * generated, [bytes(16)] * blocks)], 1.8e9,
                             params={"max_tokens": 1000, "temperature": 0.7, "seed": 1})


def figures(row: Row, interval: int = 16, block_size: int = 16, mtbf: float = 6 * 3600.0,
            min_seconds: float = 2.0) -> dict:
    R, r, P, N = row.running, row.tokens_per_second, row.prompt, row.output
    T = R * r  # worker tokens/s
    k = row.shape.kv_bytes_per_token
    kv_tokens_per_second = T * (1 + P / N)  # every generated token and, per request, its prompt once
    state = _state(P, N // 2, block_size)  # a request half-way
    mean_state = len(state.to_json())
    before_state_puts = T / interval
    before_puts = before_state_puts + kv_tokens_per_second / block_size
    before_bytes = T / interval * mean_state + k * kv_tokens_per_second
    rates = row.rates
    rates.step_seconds = 1 / r
    prompt_blocks = P // block_size
    pays = KvPolicy("auto", mtbf).worth_writing(
        rates, blocks=prompt_blocks, block_size=block_size, block_bytes=k * block_size,
        written_blocks=prompt_blocks, objects=-(-prompt_blocks // RUN_BLOCKS), remaining_steps=N)
    segment_bytes = len(encode_segment([state] * R)[0])  # a round: every running request's state
    saved = rates.recompute_seconds(prompt_blocks, block_size) - rates.load_seconds(prompt_blocks, k * block_size)
    cost = rates.write_seconds(prompt_blocks * block_size * k, -(-prompt_blocks // RUN_BLOCKS))
    breakeven = -mtbf * math.log(1 - cost / saved) if 0 < cost < saved else math.inf  # seconds left for KV to pay
    rounds = min(r / interval, 1 / min_seconds)  # a round every `interval` steps, at most one a min_seconds
    after_kv_puts = kv_tokens_per_second / (block_size * RUN_BLOCKS) if pays else 0.0
    after_puts = rounds + after_kv_puts
    after_bytes = rounds * segment_bytes + (k * kv_tokens_per_second if pays else 0.0)
    always_puts = rounds + kv_tokens_per_second / (block_size * RUN_BLOCKS)
    return {"T": T, "k": k, "state": mean_state, "before_state_puts": before_state_puts, "before_puts": before_puts,
            "before_bytes": before_bytes,
            "after_puts": after_puts, "after_bytes": after_bytes, "kv_pays": pays, "always_puts": always_puts,
            "segment_bytes": segment_bytes, "breakeven_seconds": breakeven}


def rows() -> list[Row]:
    smol = smollm2_shape()
    cpu = dict(prefill_tokens_per_second=300.0, storage_bytes_per_second=110e6, write_bytes_per_second=100e6,
               put_seconds=0.02)
    gpu = dict(prefill_tokens_per_second=20_000.0, storage_bytes_per_second=500e6, write_bytes_per_second=500e6,
               put_seconds=0.02)
    return [Row(smol, "2-core CPU, float32", 32, 10.0, 128, 160, TransferRates(**cpu)),
            Row(smol, "2-core CPU, float32", 256, 1.5, 128, 160, TransferRates(**cpu)),
            Row(LLAMA3_8B, "GPU, bf16", 256, 30.0, 1000, 500, TransferRates(**gpu)),
            Row(LLAMA3_8B, "GPU, bf16", 64, 60.0, 4000, 1000, TransferRates(**gpu))]


def _left(seconds: float) -> str:
    return "never (computing is faster than reading)" if math.isinf(seconds) else f"{seconds / 60:,.0f} min to go"


def main() -> None:
    print("| model | where | R | r tok/s | P / N | KV B/token | before: state PUTs/s | + KV PUTs/s | MB/s | $/day "
          "| after: PUTs/s | MB/s | $/day | its prompt's KV pays (auto) with more than "
          "| after with checkpoint_kv always: PUTs/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows():
        f = figures(row)
        print(f"| {row.shape.name} | {row.where} | {row.running} | {row.tokens_per_second:g} | {row.prompt} / "
              f"{row.output} | {f['k']:,} | {f['before_state_puts']:,.1f} | "
              f"{f['before_puts'] - f['before_state_puts']:,.1f} | {f['before_bytes'] / 1e6:,.1f} | "
              f"{f['before_puts'] * DAY * PUT_DOLLARS:,.2f} | {f['after_puts']:,.2f} | {f['after_bytes'] / 1e6:,.2f} | "
              f"{f['after_puts'] * DAY * PUT_DOLLARS:,.2f} | {_left(f['breakeven_seconds'])} | "
              f"{f['always_puts']:,.1f} |")

if __name__ == "__main__":
    main()
