"""A model's chat template rendered as transformers renders it, with jinja2 alone.

Chat templates are Jinja programs shipped with the model, so they are untrusted: they run in
jinja2's immutable sandbox, with the same environment transformers gives them (``trim_blocks``,
``lstrip_blocks``, loop controls, a ``tojson`` that does not escape HTML, ``raise_exception``,
``strftime_now``, a ``dict`` and a ``namespace`` that cannot reach Python internals), and the same
inputs (messages with ``None`` values dropped and the reasoning field under each of its names,
the tools as OpenAI writes them, the tokenizer's named special tokens). Importing transformers to do
this costs a second at every start; ``worker.model.tokenizer`` checks, once per tokenizer, that this
module renders what transformers renders, and falls back to transformers where it does not.

The ``{% generation %}`` tag (transformers' marker of assistant spans for training masks) is
accepted and renders its body unchanged, which is all inference needs.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing attributes that start with an underscore (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def _plain(value):
    """JSON-like data as plain built-in types; anything else becomes an inert placeholder, so a
    template never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(message: dict) -> dict:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render(source: str, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str],
           tools: list[dict] | None = None) -> str:
    """The prompt text for ``messages`` (and ``tools``, OpenAI's ``{"type": "function", "function": ...}``
    objects, as transformers hands them to the template). Raises ``TypeError`` for a message that is
    not an object and jinja2's errors (``TemplateError``) for what the template itself refuses."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be objects, not {type(message).__name__}")
        chat.append(_message(_plain(message)))
    return compile_template(source).render(messages=chat,
                                           tools=_plain(tools) if tools is not None else None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **_plain(special_tokens))
