"""A request's state inside the engine: its sampling parameters, its sequences and its result.

A request asks for ``n`` samples of one prompt. Each sample is a ``Sequence``: the prompt's token
ids followed by the tokens generated so far, how many of them are in the KV cache, and the blocks
that hold them. A request with ``n > 1`` starts as one sequence; when its prompt is computed the
engine forks it into ``n`` sequences that share the prompt's blocks (copy-on-write).
"""

from __future__ import annotations

import enum
import functools
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint every sampled token must keep: the output is then a JSON value matching a schema,
    any JSON object, a match of a regular expression, one of a list of strings, or a sentence of a
    grammar, or a tool call in a model family's own format (xgrammar's structural tag). The door (jobs/)
    builds it from ``response_format``, vLLM's ``guided_*`` / ``structured_outputs`` fields or ``tool_choice``
    and has checked that it compiles; ``worker/engine/structured/grammar.py`` compiles it
    for the engine, cached by a hash of ``(kind, value)`` and the tokenizer."""

    kind: str  # "json_schema" | "json_object" | "regex" | "choice" | "grammar" | "structural_tag"
    value: str = ""  # json_schema: the schema as canonical JSON text; regex: the pattern;
    # choice: a JSON list of the strings; grammar: EBNF (GBNF) text; json_object: "";
    # structural_tag: xgrammar's structural tag as JSON text (jobs/lines/tool_formats.py writes them)

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"structured output kind must be one of {self.KINDS}, not {self.kind!r}")


@dataclass(frozen=True)
class EmbeddingParams:
    """An embeddings request: its prompt is ``lengths`` inputs one after another, each run as a
    prefill-only sequence of its own and pooled into one unit vector (the pooling the model asks for,
    ``worker.engine.pooling``), cut to its first ``dimensions`` and normalised again. The door checks
    every bound; ``encoding_format`` is how it writes the vectors out (the engine does not read it)."""

    lengths: tuple[int, ...]
    dimensions: int | None = None  # None: the model's hidden size
    encoding_format: str = "float"  # "float" | "base64" (little-endian float32, as OpenAI)

    FORMATS = ("float", "base64")

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("an embeddings request needs at least one input, each of at least one token")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        if self.encoding_format not in self.FORMATS:
            raise ValueError(f"encoding_format must be one of {self.FORMATS}, not {self.encoding_format!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None  # None = no logprobs; k = the sampled token's and the top k
    min_tokens: int = 0
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # None = unconstrained
    # Logits processing before the draw (worker/engine/penalties.py); the defaults change nothing.
    frequency_penalty: float = 0.0  # OpenAI: minus this times each token's count in the output so far
    presence_penalty: float = 0.0  # OpenAI: minus this for each token in the output so far
    # vLLM / transformers: logits of prompt and output tokens divided (or, < 0, multiplied)
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias) pairs added to the logits
    min_p: float = 0.0  # vLLM / transformers: drop tokens less likely than min_p times the top token
    # How the answer is read back, not how tokens are drawn: the tool-call format (jobs/lines/tool_formats.py) whose
    # calls the text is parsed for; None for plain text. Kept here so the request row and its checkpoint carry it.
    tool_calls: str | None = None
    embedding: EmbeddingParams | None = None  # set: pool the prompt's inputs, sample nothing (the rest unread)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 turns it off)")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if not (-2 <= self.frequency_penalty <= 2 and -2 <= self.presence_penalty <= 2):
            raise ValueError("frequency_penalty and presence_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError("repetition_penalty must be a finite number > 0 (1 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if len(self.logit_bias) > 300 or not all(-100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias takes at most 300 token ids, each with a bias in [-100, 100]")

    @functools.cached_property  # asked of every row of a step: computed once (the parameters are frozen)
    def penalized(self) -> bool:
        """Whether a row needs the counts of its tokens (repetition, frequency or presence penalty)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before the draw (a penalty or a bias): the other rows skip it."""
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample stream: tokens, how many are computed into the KV cache, and its block table."""

    request: Request
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    table_row: int = -1  # its row of its BlockManager's ``tables`` (the block table's mirror), -1 while it holds none
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    status: SeqStatus = SeqStatus.WAITING
    admitted_order: int = -1  # when it last became running (preemption takes the latest first)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a stop string cut the text
    logprobs: list[dict] = field(default_factory=list)
    matcher: object | None = None  # a structured output's grammar matcher, past every output token
    counts: object | None = None  # worker.engine.penalties.TokenCounts, built when a penalty first needs it
    long_rope: bool = False  # past a longrope model's threshold: rotated with the long factors (worker.model.rotary)
    pooled: object | None = None  # an embeddings input: its pooled hidden state so far (worker.engine.pooling)
    cache_prefix: bool = True  # whether cached prefix blocks may stand in for computing its first tokens
    last_token_time: float | None = None  # time.perf_counter() when its last token was sampled (by this engine)
    # Overlapped steps (``Engine.step``): tokens a launched step has sampled that the host has not read yet,
    # counted in ``num_tokens`` but not in ``token_ids``; the row of the newest in that step's samples (the
    # next step takes its input from there, on the device); whether that token is certain to end it by length.
    inflight: int = 0
    inflight_row: int = -1
    finishing: bool = False
    # Speculation (worker/engine/speculative/): this step's draft tokens, scored after its last token and never
    # in ``token_ids`` until accepted; its proposer and acceptance (``policy.DraftState``), made when first needed.
    draft: list[int] = field(default_factory=list)
    spec: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.inflight

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.inflight - self.num_prompt_tokens

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    """What a caller hands the engine. ``output_token_ids`` resumes a request from a checkpoint."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # higher runs first (among its tenant's requests of the same deadline)
    tenant: str = "default"
    deadline: float | None = None  # unix time its job's completion window ends: earlier runs first; None: none
    job: str | None = None  # the job it belongs to: a job's tail starts its longest requests first
    arrival_step: int = 0  # set by the engine
    resume_output_ids: list[list[int]] = field(default_factory=list)  # per sample, from a checkpoint
    sequences: list[Sequence] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # EOS and stop_token_ids, set once by the engine (not per row per step)
    stop_set: frozenset[int] = frozenset()
    plain_greedy: bool = False  # its draw is its logits' argmax, nothing else: set once by the engine
    started: bool = False  # an engine step has run it (``Engine.on_start`` was told, before that step)
    isolated: bool = False  # stepped apart from every other request until ``Engine.release`` (``Engine.step``)
    # Its output's text is decoded by its reader (``Completion.text_of``), not by the engine: a worker's batch
    # requests, whose results the ledger's process writes, decode there, off the engine loop
    text_later: bool = False
    # A live caller waits on it (a stream): scheduled before batch work, which it may preempt
    # (worker/engine/scheduler.py); never checkpointed, its prefix never published.
    interactive: bool = False
    grammar: object | None = None  # ``params.structured`` compiled (worker/engine/structured/grammar.py), once it is
    grammar_future: Future | None = None  # the compile under way; the request is not scheduled until done
    # Who may share its cached prefix blocks: None is its tenant alone; requests with the same salt share
    # (the worker passes a tenant group's or a request's own ``cache_salt`` here, already namespaced).
    cache_salt: str | None = None
    cached_prompt_tokens: int | None = None  # of its prompt, taken from the prefix cache when first admitted
    # time.perf_counter() when it arrived (set by the engine unless its door set it: an interactive
    # request's submit) and when the engine sampled its first token: time to first token.
    arrival_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        e = self.params.embedding
        if e is not None and sum(e.lengths) != len(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: its inputs' lengths add up to {sum(e.lengths)} tokens, "
                             f"the prompt has {len(self.prompt_token_ids)}")

    @property
    def num_sequences(self) -> int:
        """Samples of a generation; inputs of an embeddings request."""
        e = self.params.embedding
        return self.params.n if e is None else len(e.lengths)

    def inputs(self) -> list[list[int]]:
        """An embeddings request's inputs, each its own token ids."""
        out, at = [], 0
        for n in self.params.embedding.lengths:
            out.append(self.prompt_token_ids[at:at + n])
            at += n
        return out

    @property
    def cache_key(self) -> str:
        """What enters its blocks' hash chain (``block_manager.hash_root``): its salt, else its tenant
        (the default tenant's is empty: the names its blocks had before tenants were kept apart)."""
        if self.cache_salt is not None:
            return self.cache_salt
        return "" if self.tenant == "default" else f"tenant:{self.tenant}"

    @property
    def is_finished(self) -> bool:
        return len(self.sequences) == self.num_sequences and all(s.is_finished for s in self.sequences)


@dataclass
class Completion:
    """One finished sample. ``text`` None: the text is decoded where it is read (``text_of``), from the
    first ``shown`` token ids, cut at ``cut`` (``Request.text_later``)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[dict] | None = None
    shown: int = 0
    cut: int | None = None

    def text_of(self, tokenizer) -> str:
        """Its text, decoded by ``tokenizer`` (the engine's model's) where the engine left that to its reader."""
        if self.text is None:
            self.text = shown_text(tokenizer, self.token_ids, self.shown, self.cut)
        return self.text


def shown_text(tokenizer, output_ids: list[int], shown: int, cut: int | None) -> str:
    """A finished sample's text: its first ``shown`` output tokens decoded, cut at ``cut`` (a stop string's start)."""
    text = tokenizer.decode(output_ids[:shown], skip_special_tokens=True)
    return text if cut is None else text[:cut]


@dataclass
class RequestOutput:
    """A finished request, as ``Engine.step`` hands it back; ``error`` (no completions) when the engine
    failed it: running it raised, and it alone (see ``Engine.step``)."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_prompt_tokens: int = 0
    error: str | None = None
    embeddings: object | None = None  # an embeddings request: a numpy float32 [inputs, dimensions], unit rows
    embedding: EmbeddingParams | None = None  # what it asked for (how the door writes the vectors)
    rejected: bool = False  # ``error`` is the request's own: what it asks cannot be run (a 400, not a 500)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)
