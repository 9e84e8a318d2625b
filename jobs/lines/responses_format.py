"""``/v1/responses`` lines: OpenAI's Responses API body read as the chat line it means, and a chat result
written back as a Response object.

A Responses body is a chat request in other words: ``instructions`` is a system message first; ``input``
the messages (a string: one user message; a list of items: messages whose content is a string or
``input_text`` parts, ``developer`` read as ``system``, and ``function_call`` / ``function_call_output``
items as an assistant's tool calls and the tool's answers); ``max_output_tokens`` is ``max_tokens``;
``text.format`` is ``response_format``; ``tools`` are chat's function tools written flat. So a line
becomes the chat line that means the same (``chat_line``), and that chat line the engine request a
chat line would be: one set of checks, one prompt, one grammar, the same tokens. An error found in the
chat line is named by the Responses field it came from (``ChatLine.error``), and the answer, a chat
completion, is written as a Response (``response_body``): a ``message`` item of ``output_text``, or
``function_call`` items, ``status`` "incomplete" where ``max_output_tokens`` cut it.

What needs state berth does not keep (``previous_response_id``, ``store``, ``conversation``) is refused
by ``jobs.lines.request_fields``, saying what to send instead; ``reasoning`` and ``include`` are taken
only where they ask for nothing (berth's models do not reason apart, and it adds nothing on request).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from jobs.lines.line_error import BatchLine, LineError
from jobs.lines.line_text import shown
from jobs.lines.request_fields import CHAT_URL
from jobs.lines.structured_outputs import SpecError

PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "min_tokens", "ignore_eos", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "logit_bias", "cache_salt")
"""Fields a Responses body shares with a chat body, handed on as they are (checked there)."""

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}  # id, status, phase: an output item sent back
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}
_PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_REASONING_KEYS = {"effort", "summary", "generate_summary"}
_RENAMED = [  # (a chat line's field, the Responses field it came from); the longest first
    ("body.response_format.json_schema", "body.text.format"),
    ("body.response_format", "body.text.format"),
    ("body.tool_choice.function", "body.tool_choice"),
    ("body.max_completion_tokens", "body.max_output_tokens"),
    ("body.max_tokens", "body.max_output_tokens"),
    ("body.messages", "body.input"),
]
_TOOL_FUNCTION = re.compile(r"^body\.tools\[(\d+)\]\.function(?=$|[.\[])")


@dataclass(frozen=True)
class ChatLine:
    """A Responses line as the chat line it means (``line``), and where each of its fields came from:
    ``sources`` maps a chat field (``body.messages[2]``) to the Responses field (``body.input[1]``)."""

    line: BatchLine
    sources: tuple[tuple[str, str], ...] = ()

    def param(self, param: str | None) -> str | None:
        """The Responses field a chat line's ``param`` names."""
        if param is None:
            return None
        for chat, ours in sorted((*self.sources, *_RENAMED), key=lambda pair: -len(pair[0])):
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return ours + param[len(chat):]
        return _TOOL_FUNCTION.sub(lambda m: f"body.tools[{m.group(1)}]", param)

    def error(self, exc: LineError) -> LineError:
        """``exc``, a chat line's error, naming the Responses field."""
        return LineError(exc.line, self.param(exc.param), exc.message, exc.custom_id, exc.code)


def chat_line(line: BatchLine) -> ChatLine:
    """The chat line ``line`` (a ``/v1/responses`` line, its fields known: ``request_fields.unknown_field``)
    means; ``LineError`` naming the Responses field that cannot be read as one."""
    try:
        return _chat_line(line)
    except SpecError as exc:
        raise LineError(line.line, exc.param, exc.message, line.custom_id) from None


def _chat_line(line: BatchLine) -> ChatLine:
    body = line.body
    _reasoning(body.get("reasoning"))
    include = body.get("include")
    if include is not None and include != []:
        raise SpecError("body.include", f"berth adds nothing to a response on request (no logprobs, no encrypted "
                        f"reasoning): remove include, got {shown(include)}")
    chat: dict[str, Any] = {name: body[name] for name in PASSED if name in body}
    messages, sources = _messages(body)
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (response_format := _text_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    return ChatLine(BatchLine(line.line, line.custom_id, CHAT_URL, chat), tuple(sources))


def _reasoning(value: Any) -> None:
    """Taken where it asks for nothing (null fields, effort "none"): refused, not ignored, where it asks."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - _REASONING_KEYS:
        raise SpecError("body.reasoning", f"must be an object of {', '.join(sorted(_REASONING_KEYS))}, "
                        f"got {shown(value)}")
    asked = [k for k, v in value.items() if v is not None and not (k == "effort" and v == "none")]
    if asked:
        raise SpecError(f"body.reasoning.{asked[0]}", "berth's models answer without a reasoning step of their own "
                        'and berth steers none: remove reasoning (or give effort "none")')


def _messages(body: dict) -> tuple[list[dict], list[tuple[str, str]]]:
    """The chat messages of ``instructions`` and ``input``, and the Responses field of each (and of each call)."""
    messages: list[dict] = []
    sources: list[tuple[str, str]] = []

    def add(message: dict, source: str) -> None:
        sources.append((f"body.messages[{len(messages)}]", source))
        messages.append(message)

    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str) or not instructions:
            raise SpecError("body.instructions", f"must be a non-empty string, got {shown(instructions)}")
        add({"role": "system", "content": instructions}, "body.instructions")
    value = body.get("input")
    if isinstance(value, str) and value:
        add({"role": "user", "content": value}, "body.input")
        return messages, sources
    if not isinstance(value, list) or not value:
        raise SpecError("body.input", "must be a non-empty string or a non-empty list of input items (messages "
                        '{"role": "user", "content": "..."}, function_call and function_call_output items), '
                        f"got {shown(value)}")
    for i, item in enumerate(value):
        where = f"body.input[{i}]"
        if not isinstance(item, dict):
            raise SpecError(where, f"must be an input item (an object), got {shown(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            add(_message(where, item), where)
        elif kind == "function_call":
            call = _call(where, item)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after an assistant's text are its calls
                add(last := {"role": "assistant", "content": None}, where)
            calls = last.setdefault("tool_calls", [])
            sources.append((f"body.messages[{len(messages) - 1}].tool_calls[{len(calls)}].function", where))
            sources.append((f"body.messages[{len(messages) - 1}].tool_calls[{len(calls)}]", where))
            calls.append(call)
        elif kind == "function_call_output":
            add(_call_output(where, item), where)
            sources.append((f"body.messages[{len(messages) - 1}].tool_call_id", f"{where}.call_id"))
            sources.append((f"body.messages[{len(messages) - 1}].content", f"{where}.output"))
        else:
            raise SpecError(f"{where}.type", "berth reads message, function_call and function_call_output items "
                            f"(text only, the whole conversation in input), got {shown(kind)}")
    return messages, sources


def _message(where: str, item: dict) -> dict:
    if extra := sorted(set(item) - _MESSAGE_KEYS):
        raise SpecError(f"{where}.{extra[0]}", "is not a field of a message item: it takes role and content")
    role = item.get("role")
    if role not in _ROLES:
        raise SpecError(f"{where}.role", f'must be "user", "system", "developer" or "assistant", got {shown(role)}')
    content = item.get("content")
    if isinstance(content, list):
        content = _text_of(f"{where}.content", content, ("input_text", "output_text") if role == "assistant"
                           else ("input_text",))
    elif not isinstance(content, str):
        raise SpecError(f"{where}.content", f"must be a string or a list of input_text parts, got {shown(content)}")
    return {"role": _ROLES[role], "content": content}


def _text_of(where: str, parts: list, kinds: tuple[str, ...]) -> str:
    """The text of content parts, joined (as a chat message's text parts are)."""
    if not parts:
        raise SpecError(where, "is an empty list: give at least one input_text part")
    texts = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise SpecError(f"{at}.type", f"berth's models read text only: give {' or '.join(kinds)} parts "
                            f'({{"type": "{kinds[0]}", "text": "..."}}), got {shown(part)}')
        if extra := sorted(set(part) - _PART_KEYS[kind]):
            raise SpecError(f"{at}.{extra[0]}", f"is not a field of an {kind} part")
        if not isinstance(part.get("text"), str):
            raise SpecError(f"{at}.text", f"must be a string, got {shown(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


def _call(where: str, item: dict) -> dict:
    if extra := sorted(set(item) - _CALL_KEYS):
        raise SpecError(f"{where}.{extra[0]}", "is not a field of a function_call item: it takes call_id, name "
                        "and arguments")
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or not item[name]:
            raise SpecError(f"{where}.{name}", f"must be a non-empty string, got {shown(item.get(name))}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(where: str, item: dict) -> dict:
    if extra := sorted(set(item) - _OUTPUT_KEYS):
        raise SpecError(f"{where}.{extra[0]}", "is not a field of a function_call_output item: it takes call_id "
                        "and output")
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise SpecError(f"{where}.call_id", f"must be a non-empty string, got {shown(item.get('call_id'))}")
    output = item.get("output")
    if isinstance(output, list):
        output = _text_of(f"{where}.output", output, ("input_text",))
    elif not isinstance(output, str):
        raise SpecError(f"{where}.output", f"must be a string or a list of input_text parts, got {shown(output)}")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _text_format(text: Any) -> dict | None:
    """``text`` as a chat line's ``response_format``; None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise SpecError("body.text", f'must be an object such as {{"format": {{"type": "json_object"}}}}, '
                        f"got {shown(text)}")
    if extra := sorted(set(text) - {"format", "verbosity"}):
        raise SpecError(f"body.text.{extra[0]}", "is not a field of text: it takes format (and verbosity)")
    if text.get("verbosity") not in (None, "medium"):
        raise SpecError("body.text.verbosity", f'berth runs only "medium" here (it does not steer the length of '
                        f"an answer: use max_output_tokens), got {shown(text['verbosity'])}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise SpecError("body.text.format.type", f'must be "text", "json_object" or "json_schema", '
                        f"got {shown(fmt.get('type') if isinstance(fmt, dict) else fmt)}")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if extra := sorted(set(fmt) - {"type", "name", "schema", "description", "strict"}):
        raise SpecError(f"body.text.format.{extra[0]}", "is not a field of a json_schema format: it takes name, "
                        "schema, description and strict")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _tools(tools: Any) -> Any:
    """Flat function tools as chat's nested ones; anything else is handed on for chat's check to name."""
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        where = f"body.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise SpecError(f"{where}.type", 'berth runs function tools only ({"type": "function", "name": ..., '
                            f'"parameters": {{...}}}}), got {shown(tool)}')
        if extra := sorted(set(tool) - _TOOL_KEYS):
            raise SpecError(f"{where}.{extra[0]}", f"is not a field of a function tool berth takes: it takes "
                            f"{', '.join(sorted(_TOOL_KEYS))}")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice  # "none", "auto", "required", or chat's check names what it is not
    if choice.get("type") != "function" or set(choice) - {"type", "name"}:
        raise SpecError("body.tool_choice", '"none", "auto", "required" or {"type": "function", "name": ...} '
                        f"(berth runs function tools only), got {shown(choice)}")
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_body(chat: dict, body: dict, request_id: str, model_name: str) -> dict:
    """The Response object of a finished request from its chat completion ``chat`` (one choice, its calls
    read); ``body`` is the Responses body asked, whose fields it echoes (empty where the asker's body is not
    at hand, as in a batch's output: then the defaults)."""
    choice = chat["choices"][0]
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    message = choice["message"]
    output = []
    if message.get("content") or not message.get("tool_calls"):
        output.append(message_item(request_id, message.get("content") or "", status))
    output += [call_item(call, status) for call in message.get("tool_calls", [])]
    usage = chat["usage"]
    return response_object(body, request_id, model_name, status, output, {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"]}, created_at=chat["created"])


def response_object(body: dict, request_id: str, model_name: str, status: str, output: list[dict],
                    usage: dict | None, created_at: int | None = None) -> dict:
    """A Response in any state (a stream's first events show it "in_progress", without output)."""
    created_at = int(time.time()) if created_at is None else created_at
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return {
        "id": f"resp_{request_id}", "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model_name, "output": output, "output_text": text,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None, "reasoning": None, "store": False, "background": False,
        "temperature": _number(body.get("temperature"), 1.0), "top_p": _number(body.get("top_p"), 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "tools": body.get("tools") or [], "truncation": "disabled",
        "metadata": body.get("metadata"), "user": body.get("user"), "usage": usage,
    }


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def message_item(request_id: str, text: str, status: str) -> dict:
    """The assistant's ``message`` output item of one ``output_text`` part."""
    return {"type": "message", "id": f"msg_{request_id}", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, status: str = "completed") -> dict:
    """A chat answer's tool call as a ``function_call`` output item (its ``call_id`` the chat call's id)."""
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}
