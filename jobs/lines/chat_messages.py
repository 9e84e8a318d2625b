"""A chat line's ``messages`` checked and put the way chat templates read them.

A message is ``{"role", "content"}`` with the content a string or a list of text parts (joined).
A tool conversation adds two shapes, as OpenAI writes them:

- an assistant message carrying ``tool_calls``: ``[{"id", "type": "function", "function": {"name",
  "arguments": "<JSON text of an object>"}}]``, its content then optional; the arguments reach the
  template as the object they spell, since templates write them out with ``tojson`` (as vLLM does);
- a ``"role": "tool"`` message: the answer to a call (its ``content``, and the ``tool_call_id`` it answers).

Every check is linear in the messages' size and says which message and field are wrong.
"""

from __future__ import annotations

import json

from jobs.lines.line_text import bad_text, shown
from jobs.lines.structured_outputs import SpecError

MAX_CALLS = 128  # tool calls in one assistant message


def template_messages(messages) -> list[dict]:
    """``messages`` as the chat template takes them; ``SpecError`` naming the message and field."""
    if not isinstance(messages, list) or not messages:
        raise SpecError("body.messages", "must be a non-empty list of messages")
    return [_message(f"body.messages[{i}]", m) for i, m in enumerate(messages)]


def _message(where: str, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise SpecError(where, "must be an object with a string role")
    calls = m.get("tool_calls")
    if calls is not None and m["role"] != "assistant":
        raise SpecError(f"{where}.tool_calls", f"only an assistant message carries tool calls, not a "
                        f"{shown(m['role'])} one")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise SpecError(f"{where}.content", "only text parts are supported")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str) and not (content is None and calls is not None):
        raise SpecError(f"{where}.content", "must be a string" + (" (or null beside tool_calls)"
                                                                  if m["role"] == "assistant" else ""))
    m = {**m, "content": content}
    for field in ("role", "content", "tool_call_id", "name"):
        text = m.get(field)
        if text is not None and not isinstance(text, str):
            raise SpecError(f"{where}.{field}", f"must be a string, got {shown(text)}")
        if text is not None and (why := bad_text(text, nul=False)):
            raise SpecError(f"{where}.{field}", why)
    if calls is not None:
        m["tool_calls"] = _calls(f"{where}.tool_calls", calls)
    return m


def _calls(where: str, calls) -> list[dict]:
    if not isinstance(calls, list) or not 1 <= len(calls) <= MAX_CALLS:
        raise SpecError(where, f"must be a list of 1 to {MAX_CALLS} calls "
                        '({"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}})')
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise SpecError(f"{at}.type", f'a call must be an object of type "function", got {shown(call)}')
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise SpecError(f"{at}.function", f'must be an object {{"name": ..., "arguments": "{{...}}"}}, '
                            f"got {shown(function)}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise SpecError(f"{at}.id", f"must be a string, got {shown(call['id'])}")
        for text, field in ((function["name"], "function.name"), (call.get("id") or "", "id")):
            if why := bad_text(text, nul=False):
                raise SpecError(f"{at}.{field}", why)
        out.append({**call, "type": "function",
                    "function": {"name": function["name"], "arguments": _arguments(f"{at}.function.arguments",
                                                                                   function.get("arguments"))}})
    return out


def _arguments(where: str, arguments) -> dict:
    if isinstance(arguments, str):
        if why := bad_text(arguments, nul=False):
            raise SpecError(where, why)
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            raise SpecError(where, "must be JSON text of an object, as the model's answer gave it") from None
    if not isinstance(arguments, dict):
        raise SpecError(where, f"must be JSON text of an object, got {shown(arguments)}")
    return arguments
