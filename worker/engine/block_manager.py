"""Fixed-size KV blocks: a free list, reference counts, a prefix cache and copy-on-write.

A block holds ``block_size`` consecutive tokens of one sequence. A full block is named by a hash
chained over every token before it and its own, so two sequences with the same first k blocks of
tokens find the same k blocks. Freed blocks keep their hash and content and stay findable until
the free list hands them out again (least recently freed first). Blocks that nothing can find
(never used, or freed without a hash) go first, lowest id first and the last freed before them, so
a worker touches as little of its KV cache's memory as its work needs (the cache is reserved, not
written: see ``worker.engine.model_runner``).

Every block table is mirrored, as it changes, in a row of ``tables`` (one array, a row a sequence that
holds blocks: ``Sequence.table_row``), from which a step's decode rows take theirs in one gather instead
of padding hundreds of Python lists every step (vLLM's persistent block table). The lists stay the truth;
only this class changes them, and it writes each change to the mirror (``_mirror``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np

from worker.engine.request import Sequence

LONG_ROPE_ROOT = b"berth:longrope"
SALT_ROOT = b"berth:salt\x00"


def hash_root(long_rope: bool, salt: str = "") -> bytes:
    """The parent of a sequence's first block: a long-rope sequence's blocks hold other keys than a
    short one's of the same tokens (``worker.model.rotary``), so they are named apart; and so are the
    blocks of sequences under another cache salt (``Request.cache_key``: the trust boundary of the
    prefix cache), so that one tenant never finds, nor learns by timing, another's prefixes. The
    unsalted roots ("" for the default tenant) are berth's names from before salts."""
    root = LONG_ROPE_ROOT if long_rope else b""
    if not salt:
        return root
    return hashlib.blake2b(SALT_ROOT + root + b"\x00" + salt.encode(), digest_size=16).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The content address of a full block: its tokens and the hash of the block before it."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: give it more memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash of a full, computed block -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next step
        # the block tables' mirror: a row per sequence holding blocks, columns past a table's length are 0
        self.tables = np.zeros((16, 16), dtype=np.int32)
        self._free_rows: list[int] = []
        self._rows = 0  # rows handed out so far (freed ones are reused first)

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def slot_utilization(self, seqs: list[Sequence]) -> float:
        """The share of the slots of the blocks ``seqs`` hold that hold a computed token (a block shared by
        several counts once, as full as its fullest holder has it): from the mirror, in a few array passes
        (walking hundreds of lists took the loop 2 ms)."""
        seqs = [seq for seq in seqs if seq.block_table]
        if not seqs:
            return 1.0
        n, bs = len(seqs), self.block_size
        rows = np.fromiter((seq.table_row for seq in seqs), dtype=np.int64, count=n)
        computed = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=n)
        lengths = np.fromiter((len(seq.block_table) for seq in seqs), dtype=np.int64, count=n)
        columns = np.arange(int(lengths.max()))
        held = columns < lengths[:, None]
        blocks = self.tables[rows, :len(columns)][held]
        filled = np.clip(computed[:, None] - columns * bs, 0, bs)[held]
        order = np.lexsort((filled, blocks))  # by block, its fullest holder last
        blocks, filled = blocks[order], filled[order]
        last = np.ones(len(blocks), dtype=bool)
        last[:-1] = blocks[1:] != blocks[:-1]
        return float(filled[last].sum()) / (int(last.sum()) * bs)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the first tokens of a sequence with nothing computed yet.

        At least one token is always left to compute: the last one yields the next token's logits.
        """
        if not self.enable_prefix_cache or not seq.cache_prefix:
            return []
        self.hash_full_blocks(seq, seq.num_tokens - 1)
        hits = []
        for h in seq.block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation
    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (), keep_free: int = 0) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens after its computed ones.

        ``hits`` (from ``prefix_hits``) are taken first and count as computed. Returns False and
        changes nothing when the free list cannot cover it and leave ``keep_free`` blocks on it.
        """
        bs = self.block_size
        if not hits and num_new_tokens == 1:  # a decode, the hot path: room in its last block, nothing shared
            computed = seq.num_computed_tokens
            if (computed % bs and computed < len(seq.block_table) * bs and self.ref_counts[seq.block_table[-1]] == 1
                    and keep_free <= len(self.free)):
                if not (computed + 1) % bs or len(seq.block_hashes) < computed // bs:  # a block to name
                    self._cache_full_blocks(seq, computed // bs, computed + 1)
                return True
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        have = len(seq.block_table) + len(hits)
        fresh = max(0, self.blocks_needed(computed + num_new_tokens) - have)
        cow = self._needs_copy(seq) and num_new_tokens > 0
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if fresh + cow + revived + keep_free > len(self.free):
            return False
        before = len(seq.block_table)
        for b in hits:
            self._take(b)
        seq.block_table.extend(hits)
        seq.num_computed_tokens = computed
        if cow:
            old = seq.block_table[-1]
            new = self._pop_free()
            self.pending_copies.append((old, new))
            self.ref_counts[old] -= 1
            seq.block_table[-1] = new
        for _ in range(fresh):
            seq.block_table.append(self._pop_free())
        if len(seq.block_table) != before or cow:
            self._mirror(seq, before - 1 if cow and not hits else before)
        self._cache_full_blocks(seq, computed // self.block_size, computed + num_new_tokens)
        return True

    def swap_in(self, seq: Sequence, num_computed_tokens: int, keep_free: int = 0) -> list[int] | None:
        """Fresh blocks for a swapped-out sequence's computed tokens (the caller copies them back), leaving
        ``keep_free`` on the free list."""
        count = self.blocks_needed(num_computed_tokens)
        if count + keep_free > len(self.free):
            return None
        seq.block_table = [self._pop_free() for _ in range(count)]
        seq.num_computed_tokens = num_computed_tokens
        self._mirror(seq, 0)
        self._cache_full_blocks(seq, 0, num_computed_tokens)
        return list(seq.block_table)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free list, tail first."""
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:  # nothing can find it: reused first, while its memory is warm
                    self.free.move_to_end(b, last=False)
        self._release_row(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Un-name the blocks a step was to fill (named when scheduled: ``_cache_full_blocks``) when
        that step failed: their content is not what their hash says."""
        for b in seq.block_table[seq.num_computed_tokens // self.block_size:]:
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None

    def trim(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Free ``seq``'s blocks past those its first ``num_tokens`` (its computed ones) fill: the KV slots
        of draft tokens it did not accept (worker/engine/speculative/verifier.py). Such a block was never
        named (drafts are not in ``token_ids``); one found named anyway is un-named, as ``forget_uncomputed``
        does."""
        keep = self.blocks_needed(seq.num_computed_tokens if num_tokens is None else num_tokens)
        for b in reversed(seq.block_table[keep:]):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                h = self.block_hash[b]
                if h is not None:
                    if self.cached.get(h) == b:
                        del self.cached[h]
                    self.block_hash[b] = None
                self.free[b] = None
                self.free.move_to_end(b, last=False)
        if keep < len(seq.block_table) and seq.table_row >= 0:
            self.tables[seq.table_row, keep:len(seq.block_table)] = 0
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent``; the first write to a shared block copies it."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        for b in child.block_table:
            self.ref_counts[b] += 1
        self._mirror(child, 0)

    def insert_cached(self, block_hash: bytes) -> int | None:
        """A free block named ``block_hash`` for the caller to fill (restoring a checkpoint).

        It stays free (evictable, most recently freed) and findable by ``prefix_hits``. None when the
        hash is cached already or no block is free.
        """
        if not self.enable_prefix_cache or block_hash in self.cached or not self.free:
            return None
        block = self._pop_free()
        self.ref_counts[block] = 0
        self.free[block] = None
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return block

    def name_resolved(self, seq: Sequence) -> None:
        """Name the full blocks of ``seq`` that ``_cache_full_blocks`` skipped while their last token was in
        flight, now that it is known."""
        if self.enable_prefix_cache and len(seq.token_ids) // self.block_size > len(seq.block_hashes):
            self._cache_full_blocks(seq, len(seq.block_hashes), seq.num_computed_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- the block tables' mirror
    def _mirror(self, seq: Sequence, start: int) -> None:
        """Write ``seq.block_table[start:]`` to its row of ``tables`` (a row given on its first blocks)."""
        table = seq.block_table
        if not table:
            return
        row = seq.table_row
        if row < 0:
            row = seq.table_row = self._free_rows.pop() if self._free_rows else self._new_row()
            start = 0
        width = self.tables.shape[1]
        if len(table) > width:
            wider = np.zeros((self.tables.shape[0], max(len(table), 2 * width)), dtype=np.int32)
            wider[:, :width] = self.tables
            self.tables = wider
        self.tables[row, start:len(table)] = table[start:]

    def _new_row(self) -> int:
        if self._rows == self.tables.shape[0]:
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self._rows += 1
        return self._rows - 1

    def _release_row(self, seq: Sequence) -> None:
        if seq.table_row >= 0:
            self.tables[seq.table_row, :len(seq.block_table)] = 0
            self._free_rows.append(seq.table_row)
            seq.table_row = -1

    # ---- internals
    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token goes into a partly filled block that another sequence also holds."""
        return (bool(seq.block_table) and seq.num_computed_tokens % self.block_size != 0
                and self.ref_counts[seq.block_table[-1]] > 1)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash ``seq``'s full blocks among its first ``num_tokens``, up to its last known token (a token
        still in flight on the device is not known: its block is named once it is, ``name_resolved``)."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(num_tokens, len(seq.token_ids)) // bs):
            parent = seq.block_hashes[i - 1] if i else hash_root(seq.long_rope, seq.request.cache_key)
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))

    def _cache_full_blocks(self, seq: Sequence, first_block: int, num_tokens: int) -> None:
        """Name the blocks that are full once this step's tokens are written.

        A block is findable as soon as its tokens are scheduled: within one step every layer
        writes the new keys and values before any attention reads them.
        """
        if not self.enable_prefix_cache:
            return
        self.hash_full_blocks(seq, num_tokens)
        for i in range(first_block, min(num_tokens // self.block_size, len(seq.block_hashes))):
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                h = seq.block_hashes[i]
                self.block_hash[block] = h
                self.cached.setdefault(h, block)
