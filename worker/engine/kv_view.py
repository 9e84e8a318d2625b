"""The engine's KV cache as checkpoints see it, as vLLM's ``KVCacheBlocks`` hides the KV manager:
a request's progress and its computed full blocks (``RequestState``), blocks read out and loaded
back by content address, prefix-cache look-ups, and prompt prefixes found shared (``SharedPrefix``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.config import Settings
from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner
from worker.engine.request import Request, SamplingParams, Sequence
from worker.engine.scheduler import SchedulerOutput
from worker.model.rotary import long_rope


@dataclass
class SampleState:
    """One sample of a running request, as a checkpoint needs it."""

    sample_index: int
    output_token_ids: list[int]
    block_hashes: list[bytes]  # content addresses of its computed full blocks, in order
    block_ids: list[int]  # where those blocks are now (valid until the next step)


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]  # empty until the prompt is computed (and n samples exist)


@dataclass
class SharedPrefix:
    """Leading blocks of a request's prompt that it found in the prefix cache: a prefix that more than
    one request has used, worth offering to other workers (``worker.checkpoint.prefix_store``)."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[int]  # where those blocks are now (valid until the next step)


class KVView:
    """The engine's requests' KV blocks by content address, over its block manager and model runner."""

    def __init__(self, block_manager: BlockManager, runner: ModelRunner, requests: dict[str, Request],
                 long_rope_from: Callable | int | None):
        self.bm = block_manager
        self.runner = runner
        self.requests = requests  # the engine's, by id (the same dict)
        self.long_rope_from = long_rope_from
        self.watch_shared_prefixes = False  # keep ``SharedPrefix``es for ``take_shared_prefixes``
        self._shared: list[SharedPrefix] = []

    @property
    def block_size(self) -> int:
        return self.bm.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values, over all layers."""
        return self.runner.kv_bytes // self.bm.num_blocks

    @property
    def block_shape(self) -> tuple[int, ...]:
        """A block's shape in ``read_blocks``'s copies: ``[layers, 2, block_size, kv_heads, head_dim]``."""
        return tuple(self.read_blocks([0])[:, :, 0].shape)

    def holds(self, request_id: str) -> bool:
        """The request is in the engine (running, waiting or preempted)."""
        return request_id in self.requests

    def progress(self) -> Iterator[tuple[str, int, bool]]:
        """Each request in the engine: its id, its output tokens so far (all samples), and whether a
        checkpoint could resume it (``resumable``)."""
        for request_id, request in self.requests.items():
            yield request_id, sum(s.num_output_tokens for s in request.sequences), resumable(request)

    def request_state(self, request_id: str) -> RequestState | None:
        """What a checkpoint of a request holds: its tokens so far and its computed full blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        samples = []
        if len(request.sequences) == request.params.n and request.params.embedding is None:
            bs = self.bm.block_size
            for seq in request.sequences:
                full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs if seq.block_table else 0
                self.bm.hash_full_blocks(seq, full * bs)
                samples.append(SampleState(seq.sample_index, list(seq.output_token_ids),
                                           list(seq.block_hashes[:full]), list(seq.block_table[:full])))
        return RequestState(request_id, list(request.prompt_token_ids), request.params, samples)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A CPU copy ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``."""
        return self.runner.read_blocks(block_ids)

    def load_blocks(self, block_hashes: list[bytes], data: torch.Tensor) -> int:
        """Put restored blocks into the prefix cache, where a resumed request finds them instead of
        recomputing; returns how many were loaded (cached ones and those without room are skipped)."""
        targets = [(i, self.bm.insert_cached(h)) for i, h in enumerate(block_hashes)]
        targets = [(i, b) for i, b in targets if b is not None]
        if targets:
            self.runner.write_blocks([b for _, b in targets], data[:, :, [i for i, _ in targets]])
        return len(targets)

    def prefix_block_hashes(self, request: Request) -> list[bytes]:
        """The names of the full blocks of ``request``'s prompt that admitting it could take from the
        prefix cache (all but the block of its last token), as the block manager will name them."""
        seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids),
                       long_rope=long_rope(self.long_rope_from, len(request.prompt_token_ids)))
        self.bm.hash_full_blocks(seq, seq.num_tokens - 1)
        return seq.block_hashes

    def cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the prefix cache holds now."""
        if not self.bm.enable_prefix_cache:
            return 0
        cached = self.bm.cached
        return next((i for i, h in enumerate(block_hashes) if h not in cached), len(block_hashes))

    def note_prefix_hits(self, plan: SchedulerOutput) -> None:
        """After a step ran: the prompt blocks its admissions found (not a resumed request's own restored
        ones), kept while ``watch_shared_prefixes`` is on."""
        if not self.watch_shared_prefixes:
            return
        bs = self.bm.block_size
        for seq, n in plan.prefix_hits:
            n = min(n, seq.num_prompt_tokens // bs)
            if n and not seq.request.resume_output_ids and not seq.request.interactive:
                self._shared.append(SharedPrefix(seq.request.request_id, seq.block_hashes[:n], seq.block_table[:n]))

    def take_shared_prefixes(self) -> list[SharedPrefix]:
        """The prefixes requests found in the prefix cache since the last call (with
        ``watch_shared_prefixes`` on); call between steps."""
        shared, self._shared = self._shared, []
        return shared


def fingerprint(model_path: str, settings: Settings) -> str:
    """Names the KV cache's meaning: model files, dtype, KV cache dtype, weight dtype and block size. Checkpointed
    blocks are reused only under the same fingerprint."""
    h = hashlib.sha256()
    path = Path(model_path)
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:  # the head and tail of each file: cheap, and different per model
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    h.update(f"{settings.dtype}:{settings.block_size}".encode())
    if settings.kv_cache_dtype != "auto":  # "auto" hashes as before: its checkpoints stay valid
        h.update(f":kv={settings.kv_cache_dtype}".encode())
    if settings.weight_dtype != "auto":  # int8 weights compute other keys and values than exact ones
        h.update(f":weights={settings.weight_dtype}".encode())
    if settings.simulated_device:  # a simulated device's blocks mean nothing to a model
        h.update(f":simulated={settings.simulated_device}".encode())
    return h.hexdigest()[:32]


def resumable(request: Request) -> bool:
    """Embeddings requests are never checkpointed: their KV lives only as long as their prefill; nor
    interactive ones: their caller is gone with the worker, and nobody would resume them."""
    p = request.params
    return (p.logprobs is None and p.embedding is None and not request.interactive
            and not any(s.is_finished for s in request.sequences))
