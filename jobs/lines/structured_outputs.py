"""The body's structured-output fields (OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) read into one ``StructuredOutput``: at most one constraint a request, fields
berth does not implement refused, sizes, schema and compile checked before a row is stored
(docs/structured-outputs.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jobs.lines.line_text import bad_text, shown
from worker.config import Settings
from worker.engine.request import StructuredOutput
from worker.engine.structured.grammar_compile import GrammarError
from worker.engine.structured.grammar_pool import CompileRules
from worker.engine.structured.schema_bounds import over_bounds

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for response_format.json_schema.name
_NEW_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}  # structured_outputs' keys -> kinds
_OLD_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}
_UNSUPPORTED = {
    "guided_json_object": "is not a field vLLM or berth reads: ask for JSON with response_format "
                          '{"type": "json_object"} or structured_outputs {"json_object": true}',
    "guided_whitespace_pattern": "is not supported: berth's JSON grammars allow the whitespace JSON allows; "
                                 "remove it",
    "structural_tag": "is not supported: use response_format, guided_* or structured_outputs instead",
}
_REASON_CHARS = 500  # of a library's reason, kept in a line's error


class SpecError(ValueError):
    """A structured-output field is wrong: ``param`` names it (``body.response_format.type``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class StructuredLimits:
    """What one request's constraint may weigh; ``Settings.structured_max_*`` and their variables."""

    schema_bytes: int
    regex_bytes: int
    grammar_bytes: int
    choices: int
    compile: CompileRules  # the compile's deadline, its processes and the bounds of a schema's shape

    @classmethod
    def of(cls, settings: Settings) -> StructuredLimits:
        return cls(settings.structured_max_schema_bytes, settings.structured_max_regex_bytes,
                   settings.structured_max_grammar_bytes, settings.structured_max_choices,
                   CompileRules.of(settings))


DEFAULT_LIMITS = StructuredLimits.of(Settings.model_construct())


@dataclass(frozen=True)
class GrammarCheck:
    """A constraint the door accepted but for its compile: ``param`` names its field, ``what`` begins
    the refusal when it does not compile (``refusal``)."""

    param: str
    spec: StructuredOutput
    what: str = "the grammar library cannot compile it"

    def refusal(self, exc: GrammarError) -> SpecError:
        return SpecError(self.param, f"{self.what}: {str(exc)[:_REASON_CHARS]}")

    def compile(self, tokenizer, limits: StructuredLimits, tenant: str) -> None:
        """Compile it now, waiting on this thread (in ``tenant``'s turn); ``SpecError`` if it does not compile."""
        from worker.engine.structured.grammar import (
            check,  # torch: paid by the first constraint, not by every door's import
        )

        try:
            check(self.spec, tokenizer, limits.compile, tenant)
        except GrammarError as exc:
            raise self.refusal(exc) from None


def structured_output(body: dict, tokenizer, limits: StructuredLimits = DEFAULT_LIMITS,
                      tenant: str = "default") -> StructuredOutput | None:
    """The one constraint ``body`` asks for, checked and compiled for ``tokenizer`` (in ``tenant``'s
    turn); None for none. Raises ``SpecError`` naming the field that is wrong."""
    grammar = structured_check(body, limits)
    if grammar is None:
        return None
    grammar.compile(tokenizer, limits, tenant)
    return grammar.spec


def structured_check(body: dict, limits: StructuredLimits = DEFAULT_LIMITS) -> GrammarCheck | None:
    """The one constraint ``body`` asks for, checked but not compiled; None for none. Raises
    ``SpecError`` naming the field that is wrong."""
    for name, why in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise SpecError(f"body.{name}", why)
    asked = [c for c in _constraints(body) if c is not None]
    if len(asked) > 1:
        raise SpecError(asked[1][0], f"a request takes one structured-output constraint, and this one comes "
                        f"with {asked[0][0]}: keep one of them")
    if not asked:
        return None
    param, kind, value = asked[0]
    return GrammarCheck(param, StructuredOutput(kind, _checked_value(param, kind, value, limits)))


def _constraints(body: dict):
    """(param, kind, raw value) of each constraint the body names; None where a field names none."""
    yield _response_format(body.get("response_format"))
    for name, kind in _OLD_FIELDS.items():
        if body.get(name) is not None:
            yield f"body.{name}", kind, body[name]
    new = body.get("structured_outputs")
    if new is None:
        return
    if not isinstance(new, dict):
        raise SpecError("body.structured_outputs", f"must be an object with one of {', '.join(_NEW_KEYS)}, "
                        f"not {shown(new)}")
    for key, value in new.items():
        param = f"body.structured_outputs.{key}"
        if key not in _NEW_KEYS:
            raise SpecError(param, f"is not supported: structured_outputs takes one of {', '.join(_NEW_KEYS)}")
        if key == "json_object":
            if value is not None and not isinstance(value, bool):
                raise SpecError(param, f"must be true or false, not {shown(value)}")
            if value:
                yield param, "json_object", None
        elif value is not None:
            yield param, _NEW_KEYS[key], value


def _response_format(rf: Any):
    param = "body.response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise SpecError(param, f'must be an object such as {{"type": "json_object"}}, not {shown(rf)}')
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return param, "json_object", None
    if kind != "json_schema":
        raise SpecError(f"{param}.type", f'must be "text", "json_object" or "json_schema", not {shown(kind)}')
    js = rf.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(js, dict):
        raise SpecError(where, 'missing or not an object: give {"name": ..., "schema": {...}}')
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise SpecError(f"{where}.name", "missing or not 1 to 64 letters, digits, '_' or '-' (OpenAI's rule), "
                        f"got {shown(name)}")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise SpecError(f"{where}.description", f"must be a string, not {shown(js['description'])}")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise SpecError(f"{where}.strict", f"must be true or false, not {shown(js['strict'])}")
    if js.get("schema") is None:
        raise SpecError(f"{where}.schema", "missing: give the JSON Schema every output must match")
    return f"{where}.schema", "json_schema", js["schema"]


def _checked_value(param: str, kind: str, value: Any, limits: StructuredLimits) -> str:
    """``StructuredOutput.value`` for a raw field value, or ``SpecError``."""
    if kind == "json_object":
        return ""
    if kind == "json_schema":
        return schema_text(param, value, limits)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SpecError(param, f"must be a non-empty list of non-empty strings, not {shown(value)}")
        if len(value) > limits.choices:
            raise SpecError(param, f"{len(value)} choices, over the limit of {limits.choices} "
                            "(BERTH_STRUCTURED_MAX_CHOICES)")
        for c in value:
            if why := bad_text(c, nul=False):
                raise SpecError(param, f"a choice {why}")
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        within(param, "the choices, as JSON text,", text, limits.grammar_bytes, "GRAMMAR")
        return text
    if not isinstance(value, str) or not value:
        raise SpecError(param, f"must be a non-empty string, not {shown(value)}")
    if kind == "regex":
        within(param, "the regular expression", value, limits.regex_bytes, "REGEX")
    else:
        within(param, "the grammar", value, limits.grammar_bytes, "GRAMMAR")
    if why := bad_text(value, nul=False):
        raise SpecError(param, why)
    return value


def schema_text(param: str, schema: Any, limits: StructuredLimits) -> str:
    """``schema`` (an object, or JSON text of one) checked for size, the metaschema and the bounds of its
    shape, as compact JSON text; ``SpecError`` naming ``param`` otherwise. A tool's parameters are checked so too."""
    limit = limits.schema_bytes
    if isinstance(schema, str):  # guided_json may carry the schema as JSON text
        if len(schema.encode("utf-8", "surrogatepass")) > limit:
            raise SpecError(param, f"the schema is {len(schema):,} characters, over the limit of {limit:,} bytes "
                            "(BERTH_STRUCTURED_MAX_SCHEMA_BYTES)")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise SpecError(param, f"a string that is not JSON text: {str(exc)[:200]}") from None
    if not isinstance(schema, dict):
        raise SpecError(param, f"must be a JSON Schema object, not {shown(schema)}")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise SpecError(param, "nested too deeply: flatten the schema (use $defs and $ref)") from None
    within(param, "the schema, as compact JSON,", text, limit, "SCHEMA")
    if why := bad_text(text, nul=False):
        raise SpecError(param, why)
    import jsonschema  # paid by the first schema checked, not by every process that imports the door

    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = exc.json_path if exc.path else "its top level"
        raise SpecError(param, f"not a valid JSON Schema: at {where}: {exc.message[:_REASON_CHARS]}") from None
    except RecursionError:
        raise SpecError(param, "nested too deeply: flatten the schema (use $defs and $ref)") from None
    if why := over_bounds(schema, limits.compile.bounds):
        raise SpecError(param, why)
    return text


def within(param: str, what: str, text: str, limit: int, setting: str) -> None:
    """``SpecError`` where ``text`` is over ``limit`` bytes (``BERTH_STRUCTURED_MAX_<setting>_BYTES``)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise SpecError(param, f"{what} is {size:,} bytes, over the limit of {limit:,} "
                        f"(BERTH_STRUCTURED_MAX_{setting}_BYTES)")
