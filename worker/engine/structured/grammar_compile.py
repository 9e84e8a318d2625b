"""One structured-output spec into one xgrammar compile call, and the errors a user reads about it.

Both the process that uses a grammar and the compile process that first tries it within its
deadline (``worker/engine/structured/grammar_pool.py``) compile through ``compile_spec``, so they compile
exactly alike: what passed the trial is what the engine then builds.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from worker.engine.request import StructuredOutput

if TYPE_CHECKING:  # imported where used: an engine that never sees a grammar never pays its import
    import xgrammar as xgr

COMPILE_THREADS = 2  # threads inside one compile, in a compile process and in the process that uses it alike
_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+\.(cc|h):\d+: |Check failed: \(.*?\) is false: ")
WHAT = {"json_schema": "the JSON schema", "json_object": "the JSON object grammar",
        "regex": "the regular expression", "choice": "the choice list", "grammar": "the grammar (EBNF/GBNF)",
        "structural_tag": "the tool call's grammar (a structural tag)"}


class GrammarError(ValueError):
    """A structured-output spec that cannot be enforced: what was wrong and what to change."""


class CompileTimeout(GrammarError):
    """A compile stopped at its deadline (``seconds``): a spec too costly for the library."""

    def __init__(self, spec: StructuredOutput, seconds: float):
        super().__init__(f"{WHAT[spec.kind]} did not compile within {seconds:g} s "
                         "(BERTH_STRUCTURED_COMPILE_SECONDS), and its compile was stopped: simplify it")
        self.seconds = seconds


class GrammarDeadEnd(GrammarError):
    """A sample's grammar allows no next token: the output so far cannot be completed (a part of the
    grammar matches nothing). The request's own spec, not the engine's fault."""


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """``spec`` compiled by ``compiler`` on the calling thread; ``GrammarError`` with the library's reason,
    or when it matches no output at all (a regex such as ``[^\x00-\U0010FFFF]``: it compiles, and a
    sample under it could draw no token)."""
    try:
        if spec.kind == "json_schema":
            compiled = compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        elif spec.kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif spec.kind == "regex":
            compiled = compiler.compile_regex(spec.value)
        elif spec.kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(spec.value))
        elif spec.kind == "structural_tag":
            compiled = compiler.compile_structural_tag(spec.value)
        else:
            compiled = compiler.compile_grammar(spec.value)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError and kin, with the reason)
        raise GrammarError(f"{WHAT[spec.kind]} does not compile: {clean(exc)}") from None
    import xgrammar as xgr

    if allows_nothing(xgr.GrammarMatcher(compiled), compiled.tokenizer_info.vocab_size):
        raise GrammarError(f"{WHAT[spec.kind]} matches no output: no token can begin one")
    return compiled


def allows_nothing(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Whether ``matcher`` allows no next token, not even the end (one mask, filled on its own)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def clean(exc: Exception) -> str:
    """xgrammar's message without its C++ file, line and check text."""
    return " ".join(_NOISE.sub("", str(exc)).split())[:500] or type(exc).__name__


def choice_grammar(value: str) -> str:
    """An EBNF grammar matching exactly one of the strings of a JSON list (JSON string escapes are
    EBNF string escapes)."""
    try:
        choices = json.loads(value)
    except ValueError as exc:
        raise GrammarError(f"the choice list must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choice list must be a non-empty JSON list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
