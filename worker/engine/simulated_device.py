"""A simulated GPU, for benchmarks and tests, never production (``--simulated-device h200:llama-3-8b``).

A model runner whose step takes the time a named model takes on a named GPU, computed from the
step's real shape by a roofline, while the CPU stays free; whose tokens are a cheap function of the
context, so greedy outputs are reproducible. With it the whole product (engine, worker, queue,
database, checkpoints) runs at a GPU's pace on a CPU, and whatever the host does between steps
shows as the device waiting.

The device is a timeline, as a CUDA stream is: ``execute`` enqueues the step and returns at once
(kernel launches are asynchronous); reading its tokens (``sample``) sleeps until the step is done,
as a ``.cpu()`` copy synchronizes, and the sleep releases the GIL. Busy seconds are counted, so a
benchmark reads the device's busy share.

A step's time (``step_seconds``): the larger of its bytes over the achievable HBM bandwidth (the
weights once, the KV read by every query row's attention, the KV written) and its FLOPs over the
achievable dense bf16 rate (2 x the matmul parameters per token, the LM head per sampled row,
attention's 4 x heads x head_dim per query and key), plus a fixed cost per step, plus sampling's
passes over the logits. The constants and their sources are on ``GPUS``.

Not modelled: kernel efficiency that varies with shape (one achievable fraction each for bandwidth
and FLOPs), attention and GEMM overlap within a step, the KV's real bytes (the simulated cache is a
tiny real tensor so that checkpoints and swaps run, its contents meaningless), host-to-device copies
of the step's inputs (small: a few KB a step), tensor parallelism, power and clock throttling, and
the tokens' meaning: text is a hash of the context, so stop strings and grammars see text no model
would write, and drafts from a job's earlier text are accepted about as rarely as from random text.

A token's context hash sums a mix of every (token, position) of its sequence so far, kept in the
stand-in cache at the token's slot, so that sequences differing anywhere write different text, and a
prefix cache hit, a swap or a checkpoint's blocks carry it as they carry a model's KV. (A hash of the
last token and position alone made every chat prompt of one length, which all end in the template's
assistant header, write the same text: drafts from the job's earlier outputs were accepted more and
more as a job ran, the rate tripling mid-job.)
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine import sampler
from worker.engine.model_runner import ModelRunner, SampleLaunch, reserve_kv_cache
from worker.engine.sampler import Sampled, SampleRow
from worker.engine.step_heap import keep_step_temporaries_in_heap
from worker.model.decoder import StepInput
from worker.model.pooling_config import model_pooling
from worker.model.rotary import long_table_row

log = logging.getLogger("berth.engine")


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float  # peak memory bandwidth
    bf16_flops: float  # peak dense bf16 tensor FLOP/s (the datasheets' "with sparsity" figure halved)
    memory_bytes: float
    bandwidth_share: float = 0.85  # of peak that decode's weight and KV streams reach
    flops_share: float = 0.70  # of peak that large bf16 GEMMs reach
    step_overhead_s: float = 40e-6  # a step's fixed cost: launches and tails of a CUDA-graphed step
    memory_share: float = 0.90  # of memory the engine takes (vLLM's gpu_memory_utilization)


# Sources: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS
# with sparsity); NVIDIA H100 datasheet (H100 SXM: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity).
# The achievable shares are this module's assumptions: memory-bound GEMV kernels are commonly measured at
# 80-90% of peak bandwidth, cuBLAS's large bf16 GEMMs at 60-75% of dense peak.
GPUS = {
    "h200": GPU("NVIDIA H200 SXM", 4.8e12, 989.5e12, 141e9),
    "h100": GPU("NVIDIA H100 SXM", 3.35e12, 989.5e12, 80e9),
}


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, as far as a step's cost depends on it."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_value: int = 2  # bf16 weights and KV

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate

    @property
    def weight_bytes(self) -> int:
        """What one step streams from memory: every layer's matrices and the LM head (untied embeddings
        are looked up, not streamed)."""
        return (self.layers * self.layer_params + self.vocab * self.hidden) * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value


# Meta's configs: Llama-3.1-8B (32 layers, 4096, 14336, 32/8 heads), Llama-3.2-1B (16 layers, 2048, 8192, 32/8).
SHAPES = {
    "llama-3-8b": Shape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128, 128256),
    "llama-3.2-1b": Shape("Llama-3.2-1B", 16, 2048, 8192, 32, 8, 64, 128256),
}


def parse(spec: str) -> tuple[GPU, Shape]:
    """'h200:llama-3-8b' -> the GPU and the shape; ValueError naming the choices."""
    gpu, _, shape = spec.partition(":")
    if gpu not in GPUS or shape not in SHAPES:
        raise ValueError(f"simulated device {spec!r}: give GPU:SHAPE with GPU one of {', '.join(GPUS)} and SHAPE "
                         f"one of {', '.join(SHAPES)} (e.g. h200:llama-3-8b)")
    return GPUS[gpu], SHAPES[shape]


def step_seconds(gpu: GPU, shape: Shape, num_tokens: int, query_keys: int, keys_read: int,
                 logits_rows: int) -> float:
    """The device time of one step: ``num_tokens`` rows through the layers, ``query_keys`` (query, key)
    pairs of attention, ``keys_read`` tokens' KV read from the cache, ``logits_rows`` rows through the
    LM head and the sampler."""
    s = shape
    flops = (2 * s.layers * s.layer_params * num_tokens + 2 * s.vocab * s.hidden * logits_rows
             + 4 * s.layers * s.heads * s.head_dim * query_keys)
    moved = s.weight_bytes + s.kv_bytes_per_token * (keys_read + num_tokens)
    sampling = 3 * logits_rows * s.vocab * 4  # the logits written, softmaxed and read (float32)
    return (max(moved / (gpu.hbm_bytes_per_s * gpu.bandwidth_share), flops / (gpu.bf16_flops * gpu.flops_share))
            + sampling / (gpu.hbm_bytes_per_s * gpu.bandwidth_share) + gpu.step_overhead_s)


class Timeline:
    """The device as a CUDA stream: work runs in order, one item at a time, from when it is enqueued or
    the previous item ends, whichever is later. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.free_at = 0.0  # perf_counter time the last enqueued item ends
        self.busy_seconds = 0.0
        self.waited_seconds = 0.0  # host time spent blocked on the device
        self.first_at: float | None = None  # perf_counter time the first item started
        self.idle_seconds = 0.0  # the device free with nothing enqueued, after its first item

    def enqueue(self, seconds: float) -> float:
        """Enqueue ``seconds`` of work; when it will be done."""
        with self._lock:
            now = time.perf_counter()
            if self.first_at is None:
                self.first_at = now
            elif now > self.free_at:
                self.idle_seconds += now - self.free_at
            start = max(now, self.free_at)
            self.free_at = start + seconds
            self.busy_seconds += seconds
            return self.free_at

    def wait(self, until: float) -> None:
        """Block (releasing the GIL) until ``until``, as a copy of a result to the host does."""
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)
            with self._lock:
                self.waited_seconds += left


_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # the golden ratio's 64 bits, as a signed int64


_HASH_MASK = (1 << 40) - 1  # a context hash: 40 bits, kept as the int64 its slot's two float32 channels hold


def next_tokens(context: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The simulated model's greedy choice: a hash of the row's context hash and its position."""
    x = context * 1_000_003 + positions
    x = (x * _MULT) ^ (x >> 29)
    return (x >> 16) % vocab


def context_hashes(step: StepInput, cache: np.ndarray, block_size: int) -> torch.Tensor:
    """Each input token's context hash: a mix of (token, position) added to the hash at the sequence's
    previous position, read from ``cache`` (an int64 a slot) where that token ran in an earlier step, or
    carried from the row before where it runs in this one (a chunk, a verified draft); written at the
    token's slot. Host numpy over the step's rows: 25 us a step of 256 decode rows (Zen 4, quiet)."""
    ids, slots, nd = step.input_ids.numpy(), step.slot_mapping.numpy(), step.num_decode
    pos = step.decode_context_lens.numpy().astype(np.int64) - 1
    prev_slot = _previous_slots(step.decode_block_tables.numpy(), np.arange(nd), pos, block_size)
    if len(ids) > nd:  # prefill chunks: each token's position and its previous one's slot
        starts = step.prefill_query_start_loc.numpy().astype(np.int64)
        chunk = np.diff(starts)
        row = np.repeat(np.arange(len(chunk)), chunk)
        chunk_pos = (step.prefill_context_lens.numpy() - chunk)[row] + np.arange(len(ids) - nd) - starts[:-1][row]
        pos = np.concatenate([pos, chunk_pos])
        prev_slot = np.concatenate([prev_slot, _previous_slots(step.prefill_block_tables.numpy(), row, chunk_pos,
                                                               block_size)])
    x = (ids * 1_000_003 + pos * 7_919) * _MULT  # int64 products wrap, as a hash wants
    values = (x ^ (x >> 29)) & _HASH_MASK
    begins = np.ones(len(ids), dtype=bool)  # rows whose previous position ran in an earlier step (or none)
    begins[1:] = prev_slot[1:] != slots[:-1]
    begins[pos == 0] = True
    kept = np.where(pos > 0, cache[prev_slot], 0)
    if begins.all():  # no chunk, no draft: every row reads its previous hash
        hashes = (values + kept) & _HASH_MASK
    else:
        values[begins] += kept[begins]
        summed = np.cumsum(values)
        hashes = (summed - (summed - values)[begins][np.cumsum(begins) - 1]) & _HASH_MASK
    cache[slots] = hashes
    return torch.from_numpy(hashes)


def _previous_slots(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of the position before each of ``positions`` (position 0's own for position 0), by its
    row of ``tables``."""
    prev = np.maximum(positions - 1, 0)
    return tables[rows, prev // block_size].astype(np.int64) * block_size + prev % block_size


class SimulatedLogits:
    """What a simulated step yields for its sampled rows: their context hash and position, when the step is
    done, and the device it ran on. Indexed by rows as a logits tensor is (an n > 1 request's forks)."""

    def __init__(self, context: torch.Tensor, positions: torch.Tensor, done_at: float):
        self.context, self.positions, self.done_at = context, positions, done_at

    def __getitem__(self, rows) -> SimulatedLogits:
        return SimulatedLogits(self.context[rows], self.positions[rows], self.done_at)

    def __len__(self) -> int:
        return len(self.context)

    @property
    def device(self) -> torch.device:
        return self.context.device


class SimulatedRunner(ModelRunner):
    """``ModelRunner``'s interface over a simulated device: the host's work (``prepare``, the block moves,
    the sampler's rows) is real, the model's is a sleep of the roofline's length."""

    def __init__(self, loaded, spec: str, *, block_size: int, max_seqs: int, max_model_len: int):
        self.gpu, self.shape = parse(spec)
        self.device = torch.device("cpu")
        self.block_size = block_size
        keep_step_temporaries_in_heap()
        self.model = None
        self.ops = None
        self.long_table_row = long_table_row(loaded.config)
        self.pooling = model_pooling(loaded.path)
        self.hidden_size = loaded.config.hidden_size
        self.vocab = loaded.config.vocab_size  # tokens are the tokenizer's; costs are the shape's
        self.timeline = Timeline()
        # the blocks the named GPU holds beside the shape's weights, at most what max_seqs requests use
        g, s = self.gpu, self.shape
        per_block = s.kv_bytes_per_token * block_size
        fits = int((g.memory_bytes * g.memory_share - s.weight_bytes) // per_block)
        self.num_blocks = max(1, min(fits, max_seqs * -(-max_model_len // block_size)))
        self.num_layers = 1
        self.kv_dtype = torch.float32
        self.block_shape = (block_size, 1, 2)  # a stand-in cache: checkpoints and swaps run, their bytes small
        self.block_bytes = per_block
        self.kv_bytes = self.num_blocks * per_block
        self.kv_caches = reserve_kv_cache(1, self.num_blocks, self.block_shape, torch.float32, self.device)
        self._hashes = self.kv_caches[0][0].numpy().view(np.int64).reshape(-1)  # a slot's two channels
        log.info("simulated device: %s running %s, %d KV blocks of %d tokens (%.1f GiB)", g.name, s.name,
                 self.num_blocks, block_size, self.kv_bytes / 2**30)

    def execute(self, step: StepInput) -> tuple[SimulatedLogits, torch.Tensor | None]:
        cut = len(step.logits_rows) - step.num_pooled
        rows = step.logits_rows[:cut]
        decode_lens = step.decode_context_lens.to(torch.int64)
        prefill_lens = step.prefill_context_lens.to(torch.int64)
        chunk = (step.prefill_query_start_loc[1:] - step.prefill_query_start_loc[:-1]).to(torch.int64)
        # a chunk of n new tokens ending at context c: its queries see c - n + 1 ... c keys
        query_keys = int(decode_lens.sum()) + int((chunk * (2 * prefill_lens - chunk + 1) // 2).sum())
        keys_read = int(decode_lens.sum()) + int(prefill_lens.sum())
        seconds = step_seconds(self.gpu, self.shape, len(step.input_ids), query_keys, keys_read, cut)
        done_at = self.timeline.enqueue(seconds)
        context = context_hashes(step, self._hashes, self.block_size)
        logits = SimulatedLogits(context[rows], step.positions[rows], done_at)
        pooled = torch.zeros(step.num_pooled, self.hidden_size) if step.num_pooled else None
        return logits, pooled

    def sample(self, logits: SimulatedLogits, rows: list[SampleRow] | None,
               grammar_mask: tuple[list[int], torch.Tensor] | None = None) -> SampleLaunch:
        """Tokens as the device's sampler gives them: the host reads them once the step is done. Plain rows
        (greedy or seeded, no logprobs, penalties, grammar or min_tokens ban) take the hash, known at once;
        the others get logits peaked at it and go through the real sampler, so every feature runs."""
        last = logits.context
        n = len(last)
        rows = rows or ()  # None: all plain greedy rows
        seeded = [i for i, r in enumerate(rows) if not r.params.greedy]
        if seeded:  # a seeded draw: the hash moved by the row's uniform number (the sampler's)
            last = last.clone()
            last[seeded] ^= torch.tensor([int(sampler.uniform(rows[i].params.seed, rows[i].sample_index,
                                                                 rows[i].position) * (1 << 30)) for i in seeded])
        tokens = next_tokens(last, logits.positions, self.vocab)
        special = [i for i, r in enumerate(rows) if _needs_logits(r)]
        if grammar_mask is not None:
            special = sorted(set(special) | set(grammar_mask[0]))
        if not special:
            def result() -> Sampled:
                self.timeline.wait(logits.done_at)
                return Sampled(tokens.tolist(), [None] * n)
            return SampleLaunch(tokens, result, lambda: time.perf_counter() >= logits.done_at)
        self.timeline.wait(logits.done_at)
        peaked = torch.zeros(len(special), self.vocab)
        peaked[torch.arange(len(special)), tokens[special]] = 8.0
        mask = None
        if grammar_mask is not None:
            where = {row: j for j, row in enumerate(special)}
            mask = ([where[i] for i in grammar_mask[0]], grammar_mask[1])
        done = sampler.sample(peaked, [rows[i] for i in special], mask)
        plain = tokens.tolist()
        logprobs: list[dict | None] = [None] * n
        for j, i in enumerate(special):
            plain[i], logprobs[i] = done.token_ids[j], done.logprobs[j]
        sampled = Sampled(plain, logprobs)
        return SampleLaunch(torch.tensor(plain), lambda: sampled)


def _needs_logits(row: SampleRow) -> bool:
    p = row.params
    return (p.logprobs is not None or p.processed
            or (row.num_output_tokens < p.min_tokens and bool(row.suppress_ids)))


__all__ = ["GPUS", "SHAPES", "GPU", "Shape", "SimulatedRunner", "Timeline", "next_tokens", "parse", "step_seconds"]
