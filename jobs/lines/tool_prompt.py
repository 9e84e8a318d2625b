"""Tools shown to a model whose chat template does not take them (the default SmolLM2).

Such a template drops ``tools`` and cannot render an assistant message whose content is a call, so a
model behind it would be asked to call functions it was never shown. Where the template never reads
``tools``, berth describes them in the system message, and asks for the plain JSON call that the
grammar then holds the answer to (``jobs.lines.tool_formats``, the ``json`` format); where it never reads
``tool_calls``, a call in the history becomes that same JSON as the assistant's text. A template that
reads them gets them as they are.
"""

from __future__ import annotations

import json

INSTRUCTION = ("You can call these functions, given as JSON Schema:\n{functions}\n"
               'To call one, answer with only a JSON object {{"name": <function name>, "arguments": <arguments '
               "object>}}.")


def for_template(messages: list[dict], tools: list[dict] | None, template) -> list[dict]:
    """``messages`` as ``template`` can render them, with ``tools`` described where it does not take them."""
    if isinstance(template, dict):  # transformers' named templates: the one it renders tools with
        template = template.get("tool_use") or template.get("default")
    source = template if isinstance(template, str) else ""
    if "tool_calls" not in source:
        messages = [_as_text(m) for m in messages]
    if tools and "tools" not in source:
        messages = _described(messages, tools)
    return messages


def _as_text(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in message["tool_calls"])
    text = f"{message['content']}\n{calls}" if message.get("content") else calls
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _described(messages: list[dict], tools: list[dict]) -> list[dict]:
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    text = INSTRUCTION.format(functions=functions)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
