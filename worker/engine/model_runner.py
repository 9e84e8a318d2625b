"""Owns the model and its KV cache; turns a scheduled step into tensors and runs it.

The KV cache is one preallocated K and one V tensor per layer, ``[num_blocks, block_size,
kv_heads, head_dim]``, sized once and never grown: by default to what ``max_num_seqs`` requests of
the longest length the engine allows can hold, at most a share of the free memory
(``worker.config.KV_AUTO_SHARE``); ``kv_memory`` sets it instead.

On the CPU the cache is reserved, not written: it lives in an anonymous memory mapping, whose
pages the kernel hands out zero-filled on their first touch. Writing zeros over a cache of a
quarter of the memory took longer than everything else a start does, for memory a job mostly never
touches; now a worker holds in memory only the blocks it has used, and a never-written slot still
reads as zero (the attention paths read padding slots and weigh them 0, which would turn a NaN of
uninitialised memory into a NaN output). The block manager hands out low block ids first, so what
a worker touches stays together. On a GPU the cache is ``torch.zeros``: device memory is
committed at allocation anyway and zeroing it costs milliseconds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import mmap
import operator
import os
from collections.abc import Callable

import numpy as np
import torch

from kernels import cpu_elementwise, kv_quant
from kernels.attention import select_ops
from worker.config import KV_AUTO_SHARE, cache_dir
from worker.engine import heap_prefault
from worker.engine.cuda_graphs import DecodeGraphs, reason_not_to
from worker.engine.pooling import PoolRows, chunk_rows
from worker.engine.request import Sequence
from worker.engine.sampler import Sampled, SampleRow, draw
from worker.engine.step_heap import keep_step_temporaries_in_heap
from worker.model.architectures import context_length
from worker.model.decoder import DecoderModel, StepInput
from worker.model.pooling_config import model_pooling
from worker.model.rotary import long_table_row
from worker.model.torch_threads import one_thread

log = logging.getLogger("berth.engine")


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on ``device`` right now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_blocks(kv_memory: float, block_bytes: int, block_size: int, max_seqs: int, max_model_len: int,
                    free_bytes) -> int:
    """How many KV blocks to reserve. ``kv_memory``: 0 (auto) = blocks for ``max_seqs`` sequences of
    ``max_model_len`` tokens each, at most ``KV_AUTO_SHARE`` of the free memory; a fraction (<= 1) =
    that share of the free memory; more = that many bytes. ``free_bytes()`` is asked only when needed."""
    if kv_memory == 0:
        wanted = max_seqs * -(-max_model_len // block_size)
        return min(wanted, int(KV_AUTO_SHARE * free_bytes() // block_bytes))
    budget = kv_memory * free_bytes() if kv_memory <= 1 else kv_memory
    return int(budget // block_bytes)


def reserve_kv_cache(num_layers: int, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A K and a V tensor ``[num_blocks, *block_shape]`` per layer, reading as zeros."""
    shape = (num_layers, 2, num_blocks, *block_shape)
    if device.type != "cpu":
        whole = torch.zeros(shape, dtype=dtype, device=device)
    else:
        nbytes = math.prod(shape) * dtype.itemsize
        try:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise ValueError(f"cannot reserve {nbytes / 2**20:.0f} MiB for the KV cache ({exc}): "
                             "lower --kv-memory (BERTH_KV_MEMORY)") from None
        whole = torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps ``region`` mapped
    return [(whole[layer, 0], whole[layer, 1]) for layer in range(num_layers)]


class ModelRunner:
    def __init__(self, loaded, *, dtype: torch.dtype, device: torch.device, block_size: int,
                 kv_memory: float, attention_backend: str = "auto", max_seqs: int = 256, max_model_len: int = 0,
                 kv_cache_dtype: str = "auto", weight_dtype: str = "auto", cuda_graphs: bool = True):
        """``max_seqs`` and ``max_model_len`` (0: the model's context) size the cache when ``kv_memory`` is 0;
        ``kv_cache_dtype`` "int8" or "fp8_e4m3" stores rows of int8 or fp8 values and their scale
        (``kernels.kv_quant``); ``weight_dtype`` "int8" multiplies by int8 weights
        (``worker.model.linear.make_int8_linear``); ``cuda_graphs``: decode steps replayed as CUDA graphs
        where the device and attention allow (``worker.engine.cuda_graphs``)."""
        self.device = device
        self.block_size = block_size
        if device.type == "cpu":
            keep_step_temporaries_in_heap()  # a step's tensors reused, not faulted in anew (worker.engine.step_heap)
        self.ops = select_ops(attention_backend, device, cache_dir("kernels"))
        # on the CPU, the heap that the weights' copies fill is faulted in beside torch's import (heap_prefault)
        prefaulted = (heap_prefault.build(loaded.path, str(dtype).removeprefix("torch."), weight_dtype)
                      if device.type == "cpu" else contextlib.nullcontext())
        with prefaulted, one_thread():  # thousands of short operations (worker.model.torch_threads)
            self.model = DecoderModel(loaded.config, loaded.weights, dtype, device, self.ops,
                                      int8_weights=weight_dtype == "int8", elementwise=self._elementwise(device))
        self.long_table_row = long_table_row(loaded.config)
        self.pooling = model_pooling(loaded.path)  # how an embeddings input's rows become its vector
        m = self.model
        self.num_layers = len(m.layers)
        quantized = kv_cache_dtype != "auto"
        self.kv_dtype = kv_quant.FORMATS[kv_cache_dtype].storage_dtype if quantized else dtype
        row = kv_quant.row_bytes(m.head_dim) if quantized else m.head_dim  # elements of a (token, kv head) row
        self.block_shape = (block_size, m.num_kv_heads, row)
        self.block_bytes = 2 * self.num_layers * block_size * m.num_kv_heads * row * self.kv_dtype.itemsize
        self.num_blocks = kv_cache_blocks(kv_memory, self.block_bytes, block_size, max_seqs,
                                          max_model_len or context_length(loaded.config),
                                          lambda: available_memory(device))
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache's memory ({kv_memory:g}: {_describe(kv_memory)}) holds no block of "
                             f"{self.block_bytes} bytes: raise --kv-memory (BERTH_KV_MEMORY)")
        self.kv_bytes = self.num_blocks * self.block_bytes
        no_graphs = reason_not_to(cuda_graphs, device, self.ops.name)
        # with graphs, one block more than the block manager hands out: the padding rows' scratch block
        self.kv_caches = reserve_kv_cache(self.num_layers, self.num_blocks + (no_graphs is None), self.block_shape,
                                          self.kv_dtype, device)
        self.graphs = None if no_graphs is not None else DecodeGraphs(
            self.model, self.kv_caches, max_rows=max_seqs,
            max_blocks=-(-(max_model_len or context_length(loaded.config)) // block_size),
            scratch_block=self.num_blocks, block_size=block_size, device=device)
        if device.type == "cuda":
            log.info("decode steps: %s", "CUDA graphs, captured per batch size on first use" if no_graphs is None
                     else f"eager ({no_graphs})")
        log.info("KV cache: %d blocks of %d tokens in %s (%.0f MiB reserved, %s)", self.num_blocks, block_size,
                 f"{kv_cache_dtype} with a scale per token and head" if quantized
                 else str(dtype).removeprefix("torch."),
                 self.kv_bytes / 2**20, "touched as used" if device.type == "cpu" else f"on {device}")

    def _elementwise(self, device: torch.device):
        """The C kernel of the decoder's norms and rotary (``kernels.cpu_elementwise``) where the attention
        path is the CPU's C kernel too (so a compiler works); None elsewhere (PyTorch's operations)."""
        if device.type != "cpu" or self.ops.name != "cpu":
            return None
        return cpu_elementwise.load(cache_dir("kernels"))

    # ---- the step
    def prepare(self, scheduled: list[tuple[Sequence, int]],
                tables: np.ndarray | None = None) -> tuple[StepInput, list[Sequence], PoolRows | None]:
        """Tensors for one forward pass, the sequences whose next token it yields (in row order), and
        the rows embeddings inputs pool (None when the step has none: the generation path as ever).

        ``scheduled`` must list single-token sequences and those verifying a draft first (the engine sorts it
        so: ``decode_rows_first``). ``tables``: the block tables' mirror of the sequences' ``BlockManager``
        (``BlockManager.tables``), from which the decode rows' tables are gathered; without it (or for a
        sequence without a row there) they are padded from the lists.
        """
        bs = self.block_size
        ids: list[int] = []
        samplers: list[Sequence] = []
        logits_rows: list[int] = []
        # decode rows: each row's query position and block table (its slot computed from both at once below)
        decode_starts: list[int] = []
        decode_tables: list[list[int]] = []
        decode_rows: list[int] = []  # each decode row's row of ``tables``
        decode_long: list[int] = []  # rows rotated with a longrope model's long factors
        prefill_pos: list[int] = []
        prefill_slots: list[int] = []
        prefill_starts = [0]
        prefill_tables, prefill_lens = [], []
        pool: PoolRows | None = None
        fill_rows: list[int] = []
        fill_from: list[int] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            tokens = seq.token_ids
            if n == 1 and not prefill_tables:  # a decode row: nearly every row of a step
                if start < len(tokens):
                    ids.append(tokens[start])
                elif seq.inflight:  # its input is still on the device: copied there
                    fill_rows.append(len(ids))
                    fill_from.append(seq.inflight_row)
                    ids.append(0)
                else:
                    ids.append(seq.draft[start - len(tokens)])
                if seq.long_rope:
                    decode_long.append(len(decode_starts))
                decode_starts.append(start)
                decode_rows.append(seq.table_row)
                decode_tables.append(seq.block_table)
                if seq.request.params.embedding is not None:
                    pool = pool or PoolRows()
                    pool.add(seq, start, len(ids) - 1, chunk_rows(self.pooling, start, start + 1, seq.num_tokens))
                elif start + 1 == len(tokens) + seq.inflight:
                    samplers.append(seq)
                    logits_rows.append(len(ids) - 1)
                continue
            end = start + n
            if seq.inflight and end > len(tokens):  # its input is still on the device: copied there
                fill_rows.append(len(ids))
                fill_from.append(seq.inflight_row)
                ids.append(0)
            else:
                ids.extend(tokens[start:end])
                if end > len(tokens):  # a draft to verify after its last token (worker.engine.speculative)
                    ids.extend(seq.draft[:end - len(tokens)])
            if _verifies(seq, n) and not prefill_tables:
                # a verified draft's tokens are decode rows too, each over the cache up to itself (all of them
                # are written to the cache before attention reads it): the decode kernel takes them in one
                # call where chunks would each be a prefill call of their own
                for p in range(start, end):
                    if seq.long_rope:
                        decode_long.append(len(decode_starts))
                    decode_starts.append(p)
                    decode_rows.append(seq.table_row)
                    decode_tables.append(seq.block_table)
            else:
                prefill_tables.append(seq.block_table)
                prefill_lens.append(end)
                prefill_starts.append(prefill_starts[-1] + n)
                p = np.arange(start, end)
                prefill_pos.extend((p + self.long_table_row if seq.long_rope else p).tolist())
                prefill_slots.extend((np.asarray(seq.block_table)[p // bs] * bs + p % bs).tolist())
            if seq.request.params.embedding is not None:
                pool = pool or PoolRows()
                pool.add(seq, start, len(ids) - n, chunk_rows(self.pooling, start, end, seq.num_tokens))
            elif end == seq.num_tokens:
                samplers.append(seq)
                logits_rows.append(len(ids) - 1)
            elif seq.draft and end == seq.num_tokens + len(seq.draft):  # a row per draft token and the bonus
                k = len(seq.draft)
                samplers += [seq] * (k + 1)
                logits_rows += range(len(ids) - 1 - k, len(ids))
        num_decode = len(decode_starts)
        starts = np.array(decode_starts, dtype=np.int64)
        decode_block_tables = _gather(tables, decode_rows, starts, bs) if tables is not None and num_decode \
            and min(decode_rows) >= 0 else _pad(decode_tables)
        decode_slots = decode_block_tables[np.arange(num_decode), starts // bs].astype(np.int64) * bs + starts % bs
        decode_pos = starts
        if decode_long:
            decode_pos = starts.copy()
            decode_pos[decode_long] += self.long_table_row
        if prefill_tables:
            pos = np.concatenate([decode_pos, np.array(prefill_pos, dtype=np.int64)])
            slots = np.concatenate([decode_slots, np.array(prefill_slots, dtype=np.int64)])
        else:
            pos, slots = decode_pos, decode_slots
        num_pooled = 0
        if pool is not None and not pool.rows:  # only chunks short of their last token (last-token pooling)
            pool = None
        if pool is not None:
            num_pooled = len(pool.rows)
            logits_rows = logits_rows + pool.rows  # after the logits rows: one final norm for both
        dev = self.device
        t = lambda a, dtype: _to_device(a, dtype, dev)  # noqa: E731
        step = StepInput(
            input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), slot_mapping=t(slots, torch.int64),
            num_decode=num_decode,
            decode_block_tables=t(decode_block_tables, torch.int32), decode_context_lens=t(starts + 1, torch.int32),
            prefill_query_start_loc=t(prefill_starts, torch.int32),
            prefill_block_tables=t(_pad(prefill_tables), torch.int32),
            prefill_context_lens=t(prefill_lens, torch.int32), logits_rows=t(logits_rows, torch.int64),
            num_pooled=num_pooled,
            from_previous=(t(fill_rows, torch.int64), t(fill_from, torch.int64)) if fill_rows else None)
        if pool is not None:
            pool.segment_ids = t(pool.segments, torch.int64)
        return step, samplers, pool

    def execute(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 logits ``[rows sampled, vocab]``, and for a step with embeddings inputs the final
        hidden states of the rows they pool ``[step.num_pooled, hidden]`` (else None). A decode-only step
        replays its CUDA graph where the runner has them (``worker.engine.cuda_graphs``); the logits are
        taken before the next step replays."""
        hidden = self.graphs.run(step) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model.forward(step, self.kv_caches)
        if not step.num_pooled:
            return self.model.logits(hidden), None
        cut = hidden.shape[0] - step.num_pooled
        return self.model.logits(hidden[:cut]), hidden[cut:]

    def sample(self, logits: torch.Tensor, rows: list[SampleRow] | None,
               grammar_mask: tuple[list[int], torch.Tensor] | None = None) -> SampleLaunch:
        """The next token of each row, drawn where the logits are (``worker.engine.sampler``). Rows that are
        all plain greedy ones (``rows`` None: the caller knows they are) take an argmax left on the device,
        read by ``SampleLaunch.result`` (on CUDA the host goes on meanwhile); others are drawn at once."""
        if grammar_mask is None and (rows is None or all(plain_greedy(r) for r in rows)):
            tokens = logits.argmax(dim=-1)
            return launched(tokens, lambda: Sampled(tokens.tolist(), [None] * len(tokens)))
        return launched(*draw(logits, rows, grammar_mask))

    # ---- block moves
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k, v = _moved(k), _moved(v)
            k[dst] = k[src]
            v[dst] = v[src]

    def read_blocks(self, blocks: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
        """``[layers, 2, len(blocks), block_size, kv_heads, head_dim]`` copied out of the cache, straight
        into the result (gathering each layer, then stacking, took 5 times as long: checkpoints read
        their blocks in the engine loop)."""
        idx = torch.tensor(blocks, device=self.device)
        k0 = self.kv_caches[0][0]
        out = torch.empty((len(self.kv_caches), 2, len(blocks), *k0.shape[1:]), dtype=k0.dtype, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            torch.index_select(_moved(k), 0, idx, out=_moved(out[layer, 0]))
            torch.index_select(_moved(v), 0, idx, out=_moved(out[layer, 1]))
        return out.to(device)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(blocks, device=self.device)
        data = _moved(data.to(self.device))
        for layer, (k, v) in enumerate(self.kv_caches):
            _moved(k)[idx] = data[layer, 0]
            _moved(v)[idx] = data[layer, 1]


def _verifies(seq: Sequence, n: int) -> bool:
    """Whether ``seq``'s ``n`` tokens this step are its last token and its draft (worker.engine.speculative)."""
    return bool(seq.draft) and n == 1 + len(seq.draft) and seq.num_computed_tokens == seq.num_tokens - 1


def decode_rows_first(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """``scheduled`` with the sequences whose tokens are decode rows (one token, or a draft verified) first."""
    if sum(map(_TOKENS, scheduled)) == len(scheduled):  # every n is 1 (and at least 1)
        return scheduled
    return sorted(scheduled, key=lambda item: not (item[1] == 1 or _verifies(*item)))


class SampleLaunch:
    """A step's draw, launched: ``tokens`` on the device at once (the next step's inputs copy from it),
    ``result()`` the tokens and logprobs on the host, waiting for the device where it must; ``ready()``
    whether ``result()`` would return without waiting (the host may do other work until then)."""

    def __init__(self, tokens: torch.Tensor, result: Callable[[], Sampled], ready: Callable[[], bool] | None = None):
        self.tokens = tokens
        self._result = result
        self._ready = ready

    def result(self) -> Sampled:
        return self._result()

    def ready(self) -> bool:
        return self._ready is None or self._ready()


def launched(tokens: torch.Tensor, result: Callable[[], Sampled]) -> SampleLaunch:
    """A draw whose readiness is the device's: on CUDA an event recorded after the tokens, else at once."""
    if tokens.is_cuda:
        event = torch.cuda.Event()
        event.record()
        return SampleLaunch(tokens, result, event.query)
    return SampleLaunch(tokens, result)


def plain_greedy(row: SampleRow) -> bool:
    """A row whose token is its logits' argmax: greedy, no logprobs, bias, penalty or ``min_tokens`` ban."""
    p = row.params
    return (p.greedy and p.logprobs is None and not p.processed
            and not (row.num_output_tokens < p.min_tokens and row.suppress_ids))


def fill_inputs(step: StepInput, previous: torch.Tensor | None) -> None:
    """Copy into ``step.input_ids`` the inputs the step before sampled (``StepInput.from_previous``), from
    its draw's tokens (``SampleLaunch.tokens``), where they are: on the device, no wait for the host."""
    if step.from_previous is not None:
        rows, source = step.from_previous
        step.input_ids[rows] = previous[source]


_TOKENS = operator.itemgetter(1)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step's host values as a tensor on ``device``. To a GPU through pinned memory: a copy from pageable
    memory waits for the work queued before it, so an overlapped step's inputs would wait for the step in
    flight; a pinned one is queued and the host goes on."""
    host = torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _moved(blocks: torch.Tensor) -> torch.Tensor:
    """KV blocks as the block moves copy them: a quantized cache's rows as bytes (the int8 format's
    are already; PyTorch has few float8 kernels, and on the CPU no indexed copy of float8)."""
    return blocks.view(torch.uint8) if kv_quant.is_quantized(blocks) else blocks


def _gather(tables: np.ndarray, rows: list[int], starts: np.ndarray, block_size: int) -> np.ndarray:
    """The decode rows' block tables from the mirror (``BlockManager.tables``), as wide as the longest context
    among them needs (the columns past a row's context are never read)."""
    return tables[rows, :int(starts.max()) // block_size + 1]


def _pad(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one array, each row padded with zeros to the longest (at least one column)."""
    if not tables:
        return np.zeros((0, 1), dtype=np.int32)
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = max(int(lengths.max()), 1)
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32,
                                                          count=int(lengths.sum()))
    return out


def _describe(kv_memory: float) -> str:
    if kv_memory == 0:
        return f"auto, at most {KV_AUTO_SHARE:g} of the free memory"
    return "a share of the free memory" if kv_memory <= 1 else "bytes"
