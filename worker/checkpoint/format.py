"""What a checkpoint is on the store: a request's state as a small JSON object, and KV blocks as
binary objects named by what they hold.

    checkpoints/v1/state/<request id>.json               one per running request, replaced as it grows
    checkpoints/v1/kv/<fingerprint>/<block hash>.kv      one per distinct full KV block, written once

A block's name is the engine's fingerprint (model files, dtype, block size) and the hash chained
over every token up to the block's end, so a prefix shared by many requests is stored once and a
block is only ever read by an engine that computes the same numbers. A state lists, per sample, the
hashes of its blocks in order; a block is written before any state that lists it. A request id
other than berth's own (a database integer) is hashed into the key: keys never carry user text.
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

VERSION = 1
ROOT = f"checkpoints/v{VERSION}"
STATE_PREFIX = f"{ROOT}/state/"
KV_PREFIX = f"{ROOT}/kv/"
PROBE_KEY = f"{ROOT}/probe"  # written to learn whether the store is back
_DATABASE_ID = re.compile(r"[0-9]{1,30}")
_BLOCK_MAGIC = b"berth-kv\x01"


class CorruptCheckpoint(ValueError):
    """A stored object that is not a checkpoint this version of berth wrote."""


def state_key(request_id: str) -> str:
    """berth's request ids (database integers) name the state as they are; any other id is hashed."""
    name = request_id if _DATABASE_ID.fullmatch(request_id) else "h-" + hashlib.sha256(request_id.encode()).hexdigest()
    return f"{STATE_PREFIX}{name}.json"


def block_key(fingerprint: str, block_hash: bytes) -> str:
    return f"{KV_PREFIX}{fingerprint}/{block_hash.hex()}.kv"


_LATER_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                   "logit_bias": (), "min_p": 0.0}
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

    @property
    def output_tokens(self) -> int:
        return sum(len(s.output_token_ids) for s in self.samples)

    def block_hashes(self) -> list[bytes]:
        """Every distinct block, each sample's in chain order (a shared prompt's blocks once)."""
        return list(dict.fromkeys(h for s in self.samples for h in s.block_hashes))

    def keep_blocks(self, durable) -> RequestCheckpoint:
        """The checkpoint listing, per sample, only the leading blocks found in ``durable``."""
        samples = []
        for s in self.samples:
            n = next((i for i, h in enumerate(s.block_hashes) if h not in durable), len(s.block_hashes))
            samples.append(SampleCheckpoint(s.index, s.output_token_ids, s.block_hashes[:n]))
        return replace(self, samples=samples)

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
        if sorted(s.index for s in self.samples) != list(range(request.params.n)):
            return (f"its samples are numbered {sorted(s.index for s in self.samples)}, "
                    f"the request asks for {request.params.n} numbered from 0")
        for s in self.samples:
            reason = _sample_mismatch(s, request, limits)
            if reason:
                return f"sample {s.index}: {reason}"
        return None

    def to_json(self) -> bytes:
        data = asdict(self)
        for s in data["samples"]:
            s["block_hashes"] = [h.hex() for h in s["block_hashes"]]
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RequestCheckpoint:
        try:
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise CorruptCheckpoint(f"checkpoint version {data.get('version')!r}, this berth reads {VERSION}")
            samples = [SampleCheckpoint(_int(s["index"]), [_int(t) for t in s["output_token_ids"]],
                                        [bytes.fromhex(h) for h in s["block_hashes"]]) for s in data.pop("samples")]
            checkpoint = cls(samples=samples, **data)
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
    parent = hash_root(long_rope(limits.long_rope_from, len(tokens)))
    for i, h in enumerate(sample.block_hashes):
        parent = chain_hash(parent, tokens[i * limits.block_size:(i + 1) * limits.block_size])
        if h != parent:
            return f"KV block {i} is named {h.hex()[:64]}, not the hash of its tokens"
    return None


def encode_block(data: torch.Tensor) -> bytes:
    """One block's K and V, ``[layers, 2, block_size, kv_heads, head_dim]``, with a checksum."""
    payload = _c_order_bytes(data)
    header = json.dumps({"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                         "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    return _BLOCK_MAGIC + len(header).to_bytes(4, "little") + header + payload


def _c_order_bytes(data: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, copied by numpy on the calling thread alone. The blocks come as
    strided views of one ``read_kv_blocks`` copy, and torch would copy each with a team of OpenMP
    threads of the writer thread's own, competing with the engine's for the cores (on the 2-core
    machine: 7.5 ms a float32 block that way, 0.5 ms this way)."""
    if data.stride(-1) != 1:  # viewed as bytes, the last dimension must be contiguous
        data = data.contiguous()
    return np.ascontiguousarray(data.view(torch.uint8).numpy()).tobytes()


def decode_block(raw: bytes) -> torch.Tensor:
    """The tensor ``encode_block`` wrote; ``CorruptCheckpoint`` for anything else or a bad checksum."""
    try:
        if not raw.startswith(_BLOCK_MAGIC):
            raise ValueError("no KV block header")
        start = len(_BLOCK_MAGIC) + 4
        end = start + int.from_bytes(raw[len(_BLOCK_MAGIC):start], "little")
        header = json.loads(raw[start:end])
        payload = raw[end:]
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["blake2b"]:
            raise ValueError("checksum mismatch")
        dtype = getattr(torch, header["dtype"])
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise CorruptCheckpoint(f"not a berth KV block: {exc}") from None
