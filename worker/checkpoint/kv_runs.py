"""KV runs read back from the store and judged: one reader for a resume (``resume.Restorer``) and for
the fleet's prefix cache (``prefix_store.PrefixStore``). A run is named by its last block's hash under
the model's fingerprint (``format.kv_key``); anyone with store access can write one, so a run whose
blocks are not the engine's shape and dtype is refused as ``CorruptCheckpoint`` (the request recomputes
them): a copy into the cache would convert another dtype's values silently."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from storage import ObjectStore
from worker.checkpoint.costs import TransferRates
from worker.checkpoint.format import CorruptCheckpoint, decode_run, kv_key
from worker.engine.kv_view import KVView


@dataclass
class KvRunRead:
    hashes: list[bytes]  # the run's blocks' hashes, as its header names them
    data: torch.Tensor  # [layers, 2, len(hashes), block_size, kv_heads, head_dim]
    nbytes: int  # as stored

    def blocks(self) -> dict[bytes, torch.Tensor]:
        return {h: self.data[:, :, i] for i, h in enumerate(self.hashes)}


class KvRunReader:
    def __init__(self, kv: KVView, store: ObjectStore, fingerprint: str):
        self.store = store
        self.fingerprint = fingerprint
        probe = kv.read_blocks([0])  # one block as the engine's cache holds it (the writer's copies too)
        self.block_shape = tuple(probe[:, :, 0].shape)
        self.block_dtype = probe.dtype

    def read(self, last: bytes) -> KvRunRead:
        """The run named ``last``; raises ``ObjectNotFound``, ``StorageError`` or ``CorruptCheckpoint``."""
        raw = self.store.get(kv_key(self.fingerprint, last))
        run_hashes, data = decode_run(raw)
        if tuple(data[:, :, 0].shape) != self.block_shape:
            raise CorruptCheckpoint(f"KV blocks of shape {tuple(data[:, :, 0].shape)}, not {self.block_shape}")
        if data.dtype != self.block_dtype:
            raise CorruptCheckpoint(f"KV blocks of dtype {str(data.dtype).removeprefix('torch.')}, not "
                                    f"{str(self.block_dtype).removeprefix('torch.')}")
        return KvRunRead(run_hashes, data, len(raw))


def reads_faster(rates: TransferRates, num_blocks: int, block_bytes: int, block_size: int) -> bool:
    """Whether reading ``num_blocks`` KV blocks back from the store beats computing them again."""
    return num_blocks > 0 and rates.load_seconds(num_blocks, block_bytes) < rates.recompute_seconds(num_blocks,
                                                                                                    block_size)
