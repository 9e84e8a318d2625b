"""What a checkpoint is on the store: the states of a round's requests together in one segment
object, and KV blocks in runs of consecutive blocks named by what they hold.

    checkpoints/v2/states/<writer>/<round>.seg     one per checkpoint round of a worker: the due states
                                                   of all its requests, written once, never replaced
    checkpoints/v2/kv/<fingerprint>/<hash>.kv      a run of consecutive full KV blocks of one chain,
                                                   named by the hash of its last block, written once

Why segments: a state object per request made a worker's PUTs grow with its running requests (a GPU
worker decoding 256 requests at 30 tokens/s wrote ~480 a second). A segment holds every state a round
wrote, so a worker PUTs one object per round, whatever it runs. A request finds its latest state
through a ``StateRef`` (the segment's key and the byte range of its state in it) that the worker
records where the request lives (the jobs database's row): one ranged read, never a search. Segments
are immutable: a reader sees a whole state of a whole segment or none, never a torn mix; a newer
state is a newer segment and a newer ref.

Why runs: a block per object made a request's KV as many PUTs as it has blocks. A run holds several
consecutive blocks of one hash chain; its header lists their hashes, so a block is found by its hash
inside the run. A run is named by the hash chained over every token up to its last block (the
engine's fingerprint first: model files, dtype, block size), so identical content gets one name, and
the first run of a request ends at its prompt's last full block: a later prefix store can look up a
prompt's blocks by the hash of that block (``kv_key(fingerprint, hash)``: one GET), then follow the
run's first hash back to the run before it. A state lists the runs that hold its blocks; a run is
written before any state that lists it. A request id other than berth's own (a database integer) is
hashed into what is stored: keys never carry user text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from worker.engine.block_manager import chain_hash, hash_root
from worker.engine.request import Request, SamplingParams
from worker.model.rotary import long_rope

VERSION = 2
ROOT = f"checkpoints/v{VERSION}"
SEGMENT_PREFIX = f"{ROOT}/states/"
KV_PREFIX = f"{ROOT}/kv/"
PROBE_KEY = f"{ROOT}/probe"  # written to learn whether the store is back
LEGACY_PREFIX = "checkpoints/v1/"  # berth's per-request states and per-block objects, before segments
_DATABASE_ID = re.compile(r"[0-9]{1,30}")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RUN_MAGIC = b"berth-kvrun\x01"
_SEGMENT_MAGIC = b"berth-segment\x01\n"
_REF = re.compile(rf"({re.escape(SEGMENT_PREFIX)}[A-Za-z0-9_-]{{1,64}}/[0-9]{{1,20}}\.seg)"
                  rf"@([0-9]{{1,15}})\+([0-9]{{1,12}})")
MAX_STATE_BYTES = 64 << 20  # a ref naming a longer range is not one berth wrote
RUN_BLOCKS = 8  # blocks a KV run holds at most: one aligned window of its chain (128 tokens at block size 16)


class CorruptCheckpoint(ValueError):
    """A stored object that is not a checkpoint this version of berth wrote."""


def segment_key(writer: str, round_: int) -> str:
    """The segment of ``writer``'s (a name made once per checkpoint writer) round number ``round_``."""
    if not _NAME.fullmatch(writer):
        raise ValueError(f"{writer!r} is not a segment writer name (1-64 letters, digits, '_' or '-')")
    return f"{SEGMENT_PREFIX}{writer}/{round_:010d}.seg"


def kv_key(fingerprint: str, last_block_hash: bytes) -> str:
    """The run of KV blocks whose last block has ``last_block_hash`` (a prefix's lookup key too)."""
    return f"{KV_PREFIX}{fingerprint}/{last_block_hash.hex()}.kv"


def stored_request_id(request_id: str) -> str:
    """A request id as a segment stores it: berth's own ids (database integers) as they are, any other hashed."""
    return request_id if _DATABASE_ID.fullmatch(request_id) else "h-" + hashlib.sha256(request_id.encode()).hexdigest()


@dataclass(frozen=True)
class StateRef:
    """Where a request's latest state is: a segment and the byte range of the state in it. Written as
    text (``str``) where the request lives (its database row), read back with ``parse``."""

    key: str
    offset: int
    length: int

    def __str__(self) -> str:
        return f"{self.key}@{self.offset}+{self.length}"

    @classmethod
    def parse(cls, text: str) -> StateRef:
        """``CorruptCheckpoint`` for anything but a ref berth writes (it names only segments)."""
        m = _REF.fullmatch(text or "")
        if not m or int(m.group(3)) > MAX_STATE_BYTES:
            raise CorruptCheckpoint(f"{(text or '')[:120]!r} is not a checkpoint state reference")
        return cls(m.group(1), int(m.group(2)), int(m.group(3)))


def runs_holding(checkpoint: RequestCheckpoint, run_blocks: int = RUN_BLOCKS) -> dict[bytes, bytes]:
    """Which of ``checkpoint``'s runs holds each of its blocks: block hash -> the run's last hash. A run
    named by block ``j`` of a chain holds that chain's blocks from the start of ``j``'s aligned window
    of ``run_blocks`` blocks to ``j`` (``Checkpointer`` writes them so)."""
    runs, held = set(checkpoint.kv_runs), {}
    for s in checkpoint.samples:
        chain = s.block_hashes
        for i, h in enumerate(chain):
            window_end = min((i // run_blocks + 1) * run_blocks, len(chain))
            last = next((chain[j] for j in range(i, window_end) if chain[j] in runs), None)
            if last is not None:
                held.setdefault(h, last)
    return held


_LATER_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                   "logit_bias": (), "min_p": 0.0,
                   "tool_calls": None, "embedding": None}
"""Sampling fields added after checkpoints existed, with the values that leave them out of the digest."""


def request_digest(prompt_token_ids: list[int], params: SamplingParams) -> str:
    """Names what a request asks for, so a checkpoint is applied only to the same request."""
    fields = asdict(params)
    for name, default in _LATER_DEFAULTS.items():  # a request that does not use them keeps its digest
        if fields.get(name) == default:
            del fields[name]
    what = json.dumps([list(prompt_token_ids), fields], sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class EngineLimits:
    """What the engine restoring a checkpoint can run: a checkpoint must stay inside it to apply."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # prompt and generated tokens together
    block_size: int  # tokens per KV block, for the block hashes
    long_rope_from: int | None = None  # a longrope model's threshold: longer sequences hash from another root


@dataclass(frozen=True)
class SampleCheckpoint:
    index: int
    output_token_ids: list[int]
    block_hashes: list[bytes]  # its full KV blocks, in order


@dataclass(frozen=True)
class RequestCheckpoint:
    """A request's progress: enough to continue it token for token on any worker."""

    request_id: str
    fingerprint: str
    request_digest: str  # of the prompt and the sampling parameters: what decides a match
    prompt_tokens: int
    samples: list[SampleCheckpoint]
    saved_at: float  # unix time the engine's state was read
    version: int = VERSION
    params: dict = field(default_factory=dict)  # the sampling parameters (seed among them), for people to read
    kv_runs: list[bytes] = field(default_factory=list)  # last block hashes of the runs holding its blocks

    @property
    def output_tokens(self) -> int:
        return sum(len(s.output_token_ids) for s in self.samples)

    def block_hashes(self) -> list[bytes]:
        """Every distinct block, each sample's in chain order (a shared prompt's blocks once)."""
        return list(dict.fromkeys(h for s in self.samples for h in s.block_hashes))

    def keep_blocks(self, durable) -> RequestCheckpoint:
        """The checkpoint listing, per sample, only the leading blocks found in ``durable`` (a mapping
        of block hash to the last hash of the run on the store that holds it), and those runs."""
        samples = []
        for s in self.samples:
            n = next((i for i, h in enumerate(s.block_hashes) if durable.get(h) is None), len(s.block_hashes))
            samples.append(SampleCheckpoint(s.index, s.output_token_ids, s.block_hashes[:n]))
        kept = replace(self, samples=samples)
        return replace(kept, kv_runs=list(dict.fromkeys(durable.get(h) for h in kept.block_hashes())))

    def mismatch(self, request: Request, fingerprint: str, limits: EngineLimits) -> str | None:
        """Why this checkpoint cannot continue ``request`` on an engine with ``fingerprint`` and
        ``limits``; None if it can. Anyone with access to the store can write a checkpoint, so its
        contents are held to what the engine itself would have written, not only its identity."""
        if self.request_id != request.request_id:
            return f"it belongs to request {self.request_id!r}"
        if self.request_digest != request_digest(request.prompt_token_ids, request.params):
            return "the request's prompt or sampling parameters differ"
        if self.fingerprint != fingerprint:
            return f"it was made by another model, dtype or block size (fingerprint {self.fingerprint})"
        if self.prompt_tokens != len(request.prompt_token_ids):
            return f"it counts {self.prompt_tokens} prompt tokens, the request has {len(request.prompt_token_ids)}"
        if len(self.kv_runs) > len(self.block_hashes()):
            return f"it names {len(self.kv_runs)} KV runs for {len(self.block_hashes())} blocks"
        if sorted(s.index for s in self.samples) != list(range(request.params.n)):
            return (f"its samples are numbered {sorted(s.index for s in self.samples)}, "
                    f"the request asks for {request.params.n} numbered from 0")
        for s in self.samples:
            reason = _sample_mismatch(s, request, limits)
            if reason:
                return f"sample {s.index}: {reason}"
        return None

    def to_json(self) -> bytes:
        """Built field by field, not with ``asdict``: its deep copy of every token list was most of a
        checkpoint round's host time at a GPU's pace (a round snapshots every running request)."""
        data = {"request_id": self.request_id, "fingerprint": self.fingerprint,
                "request_digest": self.request_digest, "prompt_tokens": self.prompt_tokens,
                "samples": [{"index": s.index, "output_token_ids": s.output_token_ids,
                             "block_hashes": [h.hex() for h in s.block_hashes]} for s in self.samples],
                "saved_at": self.saved_at, "version": self.version, "params": self.params,
                "kv_runs": [h.hex() for h in self.kv_runs]}
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RequestCheckpoint:
        try:
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise CorruptCheckpoint(f"checkpoint version {data.get('version')!r}, this berth reads {VERSION}")
            samples = [SampleCheckpoint(_int(s["index"]), [_int(t) for t in s["output_token_ids"]],
                                        [bytes.fromhex(h) for h in s["block_hashes"]]) for s in data.pop("samples")]
            kv_runs = [bytes.fromhex(h) for h in data.pop("kv_runs", [])]
            checkpoint = cls(samples=samples, kv_runs=kv_runs, **data)
            if not (isinstance(checkpoint.request_id, str) and isinstance(checkpoint.fingerprint, str)):
                raise TypeError("request_id and fingerprint must be strings")
            return checkpoint
        except CorruptCheckpoint:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptCheckpoint(f"not a berth checkpoint state: {exc}") from None


def _int(value) -> int:
    """A JSON integer as it is: no strings, floats or booleans read as one."""
    if type(value) is not int:
        raise TypeError(f"{value!r:.40} is not an integer")
    return value


def _sample_mismatch(sample: SampleCheckpoint, request: Request, limits: EngineLimits) -> str | None:
    """Why one sample's tokens and blocks are not what an engine could have checkpointed.

    The engine ends a sample in the step that brings it to ``max_tokens`` or to the model's context,
    and the checkpointer never snapshots a request with a finished sample: so a sample holds at most
    ``max_tokens - 1`` generated tokens and fewer than ``max_model_len`` tokens in all. Its blocks are
    the hash chain of its first tokens, one per full block of computed tokens, and the engine never
    computes a sequence's last token before sampling the next: at most ``(tokens - 1) // block_size``.
    """
    out, prompt = sample.output_token_ids, request.prompt_token_ids
    most = request.params.max_tokens - 1
    if len(out) > most:
        return (f"{len(out)} generated tokens, more than the {most} a request of max_tokens {most + 1} "
                f"is checkpointed with")
    if len(prompt) + len(out) >= limits.max_model_len:
        return (f"{len(prompt)} prompt + {len(out)} generated tokens reach the model's context of "
                f"{limits.max_model_len}")
    bad = next((t for t in out if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the model's vocabulary of {limits.vocab_size}"
    tokens = list(prompt) + list(out)
    if len(sample.block_hashes) > (len(tokens) - 1) // limits.block_size:
        return f"{len(sample.block_hashes)} KV blocks named, more than its {len(tokens)} tokens fill"
    parent = hash_root(long_rope(limits.long_rope_from, len(tokens)), request.cache_key)
    for i, h in enumerate(sample.block_hashes):
        parent = chain_hash(parent, tokens[i * limits.block_size:(i + 1) * limits.block_size])
        if h != parent:
            return f"KV block {i} is named {h.hex()[:64]}, not the hash of its tokens"
    return None


def encode_segment(states: list[RequestCheckpoint]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """One round's states as one object, and where each is in it (request id -> offset, length).

    The states as JSON one after another, each on a line of its own, then an index (a JSON line of
    stored request id -> [offset, length]) and the index's offset as 16 digits: a state is read by
    its range alone, the index serves people and the collection."""
    parts, offset, where = [_SEGMENT_MAGIC], len(_SEGMENT_MAGIC), {}
    for state in states:
        raw = state.to_json()
        where[state.request_id] = (offset, len(raw))
        parts += [raw, b"\n"]
        offset += len(raw) + 1
    index = {stored_request_id(rid): list(span) for rid, span in where.items()}
    parts += [json.dumps(index, separators=(",", ":")).encode(), b"\n", b"%016d" % offset]
    return b"".join(parts), where


def segment_states(raw: bytes) -> dict[str, RequestCheckpoint]:
    """Every state of a segment, by request id; ``CorruptCheckpoint`` for anything else."""
    try:
        if not raw.startswith(_SEGMENT_MAGIC) or len(raw) < len(_SEGMENT_MAGIC) + 16:
            raise ValueError("no segment header")
        index = json.loads(raw[int(raw[-16:]):-16])
        states = {}
        for offset, length in index.values():
            state = RequestCheckpoint.from_json(raw[_int(offset):_int(offset) + _int(length)])
            states[state.request_id] = state
        return states
    except CorruptCheckpoint:
        raise
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"not a berth checkpoint segment: {exc}") from None


def encode_run(hashes: list[bytes], data: torch.Tensor) -> bytes:
    """A run of consecutive blocks, ``data`` ``[layers, 2, len(hashes), block_size, kv_heads, head_dim]``,
    with their hashes in order and a checksum."""
    payload = _c_order_bytes(data)
    header = json.dumps({"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                         "hashes": [h.hex() for h in hashes],
                         "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    return _RUN_MAGIC + len(header).to_bytes(4, "little") + header + payload


def _c_order_bytes(data: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, copied by numpy on the calling thread alone. The blocks come as
    strided views of one ``read_kv_blocks`` copy, and torch would copy each with a team of OpenMP
    threads of the writer thread's own, competing with the engine's for the cores (on the 2-core
    machine: 7.5 ms a float32 block that way, 0.5 ms this way)."""
    if data.stride(-1) != 1:  # viewed as bytes, the last dimension must be contiguous
        data = data.contiguous()
    return np.ascontiguousarray(data.view(torch.uint8).numpy()).tobytes()


def decode_run(raw: bytes) -> tuple[list[bytes], torch.Tensor]:
    """The hashes and blocks ``encode_run`` wrote; ``CorruptCheckpoint`` for anything else or a bad checksum."""
    try:
        if not raw.startswith(_RUN_MAGIC):
            raise ValueError("no KV run header")
        start = len(_RUN_MAGIC) + 4
        end = start + int.from_bytes(raw[len(_RUN_MAGIC):start], "little")
        header = json.loads(raw[start:end])
        payload = raw[end:]
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            raise ValueError("checksum mismatch")
        hashes = [bytes.fromhex(h) for h in header["hashes"]]
        shape = [_int(d) for d in header["shape"]]
        if len(shape) != 6 or shape[2] != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for blocks of shape {shape}")
        dtype = getattr(torch, header["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{header['dtype']!r} is not a dtype")
        return hashes, torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise CorruptCheckpoint(f"not a berth KV run: {exc}") from None
