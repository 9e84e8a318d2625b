"""A chat line's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as OpenAI defines them: what the
prompt shows, what the output is held to, how the answer is read. A family with no call format of its
own takes only the constrained choices; "auto" there is refused (docs/request-fields.md, "Tool calls").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jobs.lines.line_text import bad_text, shown
from jobs.lines.structured_outputs import GrammarCheck, SpecError, StructuredLimits, schema_text, within
from jobs.lines.tool_formats import ToolFormat, call_schema, format_of
from worker.engine.request import StructuredOutput
from worker.engine.structured.schema_bounds import over_bounds

MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_NO_ARGUMENTS = {"type": "object", "properties": {}}
_REASON_CHARS = 500


@dataclass(frozen=True)
class ToolPlan:
    """What a line's tools do: ``template_tools`` for the chat template (None: none shown),
    ``structured`` the constraint of a required call (None: free text), ``tool_calls`` the format
    the answer is read in (None: plain text)."""

    template_tools: list[dict] | None = None
    structured: StructuredOutput | None = None
    tool_calls: str | None = None


NO_TOOLS = ToolPlan()


def tool_plan(body: dict, tokenizer, limits: StructuredLimits) -> ToolPlan:
    """The plan for a chat body, checked but for the compile of its constraint (``compile_plan``);
    ``SpecError`` naming the field that is wrong."""
    tools = _tools(body.get("tools"), limits)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise SpecError("body.parallel_tool_calls", f"must be true or false, got {shown(parallel)}")
    choice, named = _choice(body.get("tool_choice"), tools)
    if choice == "none":
        return NO_TOOLS
    fmt = format_of(getattr(tokenizer, "chat_template", None))
    template_tools = [{"type": "function", "function": f} for f in tools.values()]
    if choice == "auto":
        if not fmt.reads_free_text:
            raise SpecError("body.tool_choice", '"auto" (the default when tools are given) needs a model family '
                            "with a tool-call format of its own (Qwen's <tool_call> blocks, Llama 3.1's JSON call, "
                            "Mistral's [TOOL_CALLS]), and this model's chat template has none: set tool_choice to "
                            '"required" or {"type": "function", "function": {"name": ...}}, which berth holds to a '
                            'JSON call {"name": ..., "arguments": {...}}')
        return ToolPlan(template_tools, None, fmt.name)
    functions = [(name, tools[name].get("parameters", _NO_ARGUMENTS)) for name in ([named] if named else tools)]
    return ToolPlan(template_tools, _constraint(fmt, functions, parallel is not False, limits), fmt.name)


def compile_plan(plan: ToolPlan, tokenizer, limits: StructuredLimits, tenant: str = "default") -> None:
    """Compile the plan's constraint for ``tokenizer`` in ``tenant``'s turn (cached for the engine),
    or ``SpecError``: done last, once the cheaper checks of the line passed."""
    if (grammar := plan_check(plan)) is not None:
        grammar.compile(tokenizer, limits, tenant)


def plan_check(plan: ToolPlan) -> GrammarCheck | None:
    """The plan's constraint, to compile (``compile_plan``); None for none."""
    if plan.structured is None:
        return None
    return GrammarCheck("body.tool_choice", plan.structured, "the grammar library cannot compile a call of these tools")


def _tools(value, limits: StructuredLimits) -> dict[str, dict]:
    """The functions of ``tools`` by name (each as given, with its parameters checked)."""
    if value is None:
        return {}
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TOOLS:
        raise SpecError("body.tools", f"must be a list of 1 to {MAX_TOOLS} tools "
                        '({"type": "function", "function": {"name": ..., "parameters": {...}}}), '
                        f"got {shown(value)}")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(value):
        where = f"body.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise SpecError(f"{where}.type", f'must be "function" (the only kind of tool), in an object '
                            f'{{"type": "function", "function": {{...}}}}, got {shown(tool)}')
        if extra := sorted(set(tool) - {"type", "function"}):
            raise SpecError(f"{where}.{extra[0]}", "is not a field of a tool: it takes type and function")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise SpecError(f"{where}.function", f'missing or not an object {{"name": ..., "parameters": {{...}}}}, '
                            f"got {shown(function)}")
        function = _function(f"{where}.function", function, limits)
        if function["name"] in functions:
            raise SpecError(f"{where}.function.name", f"{function['name']!r} names an earlier tool too: "
                            "each tool needs its own name")
        functions[function["name"]] = function
    return functions


def _function(where: str, function: dict, limits: StructuredLimits) -> dict:
    if unknown := sorted(set(function) - set(_FUNCTION_KEYS)):
        raise SpecError(f"{where}.{unknown[0]}", f"is not a field of a function: it takes {', '.join(_FUNCTION_KEYS)}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise SpecError(f"{where}.name", "missing or not 1 to 64 letters, digits, '_' or '-' (OpenAI's rule), "
                        f"got {shown(name)}")
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise SpecError(f"{where}.description", f"must be a string, got {shown(description)}")
        if why := bad_text(description, nul=False):
            raise SpecError(f"{where}.description", why)
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise SpecError(f"{where}.strict", f"must be true or false, got {shown(function['strict'])}")
    if function.get("parameters") is None:
        return {k: v for k, v in function.items() if v is not None and k != "parameters"}
    parameters = json.loads(schema_text(f"{where}.parameters", function["parameters"], limits))
    if parameters.get("type", "object") != "object":
        raise SpecError(f"{where}.parameters.type", f'must be "object" (a call\'s arguments are an object), '
                        f"got {shown(parameters['type'])}")
    return {**{k: v for k, v in function.items() if v is not None}, "parameters": parameters}


def _choice(value, tools: dict[str, dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the function's name for the last)."""
    param = "body.tool_choice"
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise SpecError(param, f"{value!r} needs tools to call: give body.tools, or remove tool_choice")
        return value, None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise SpecError(param, '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                        f"got {shown(value)}")
    name = value["function"].get("name")
    if not isinstance(name, str) or name not in tools:
        known = ", ".join(repr(n) for n in list(tools)[:20]) or "none: body.tools is missing"
        raise SpecError(f"{param}.function.name", f"{shown(name)} is not a function of body.tools "
                        f"(they are {known}): name one of them")
    return "function", name


def _constraint(fmt: ToolFormat, functions: list[tuple[str, dict]], parallel: bool,
                limits: StructuredLimits) -> StructuredOutput:
    """The structural tag of a call, checked as a whole (size, shape)."""
    whole = call_schema(functions, fmt.args_key)
    text = json.dumps(fmt.constraint(functions, parallel), ensure_ascii=False, separators=(",", ":"))
    within("body.tools", "the schema of a call (the functions' parameters together)", text, limits.schema_bytes,
           "SCHEMA")
    if why := over_bounds(whole, limits.compile.bounds):
        raise SpecError("body.tools", f"the schema of a call (the functions' parameters together): {why}")
    return StructuredOutput("structural_tag", text)
