"""One structured-output spec into one xgrammar compile call, and the errors a user reads about it.

Both the process that uses a grammar and the compile process that first tries it within its
deadline (``worker/engine/grammar_pool.py``) compile through ``compile_spec``, so they compile
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


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """``spec`` compiled by ``compiler`` on the calling thread; ``GrammarError`` with the library's reason."""
    try:
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.value))
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.value)
        return compiler.compile_grammar(spec.value)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError and kin, with the reason)
        raise GrammarError(f"{WHAT[spec.kind]} does not compile: {clean(exc)}") from None


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
