"""Does berth's ``FastTokenizer`` give what transformers' tokenizer gives, for one model?

Run once per tokenizer, when ``worker.model.tokenizer`` first converts it: texts that exercise
normalisation, byte fallback, whitespace, digits, contractions, scripts and the special tokens
themselves, encoded with and without special tokens and decoded back with and without them; single
tokens spread over the vocabulary; and conversations through the chat template, as text and as ids,
with and without tools (and a tool call and its answer in the history).
A tokenizer that differs anywhere is read with transformers from then on.
"""

from __future__ import annotations

TEXTS = (
    "Hello, world!", "", " ", "  two leading, two trailing  ", "tabs\tand\nnew\n\nlines\r\n", "a" * 64,
    "Ünïcode: café, naïve, Straße, 日本語のテキスト, 한국어, Ελληνικά, русский, مرحبا بالعالم, हिन्दी",
    "emoji 🚀👍🏽👨‍👩‍👧 and symbols ∑∫√∞ ©®™ €£¥", "e\u0301 combining, zero\u200bwidth, nbsp\u00a0here",
    "def f(x):\n    return x ** 2  # comment\n\tif x != 0: print(f'{x:>8}')",
    "numbers 0 7 42 1234567890 3.14159 -2e-10 1,000,000", "don't won't I'm you're it's we've they'll 'quoted'",
    "Hello .  world ? yes ! a , b", "<html><body class=\"x\">&amp;</body></html>", "{\"key\": [1, 2, {\"n\": null}]}",
    "UPPER lower MiXeD  ", "\u0000\u0001 control \u007f", "\ufffd replacement, \U0001f9ea test tube",
)

CHATS = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode, 日本語 and code: x += 1"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "  and 3+3?\n"}],
    [{"role": "user", "content": "named", "name": "bob"}, {"role": "assistant", "content": None}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "then"}],
    [{"role": "user", "content": "think", "reasoning_content": "hmm"}],
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHATS = (  # rendered with TOOLS: a request, then a call made and its answer in the history
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\"}"}],
)


def _ids(encoded) -> list[int]:
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 (a template may refuse a conversation: both must refuse)
        return ("raises", type(exc).__name__)


def differences(fast, hf) -> str | None:
    """The first way ``fast`` differs from ``hf``, in words, or None where they agree on every sample."""
    if len(fast) != len(hf):
        return f"the vocabulary has {len(fast)} tokens, transformers says {len(hf)}"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(fast, name) != getattr(hf, name):
            return f"{name} is {getattr(fast, name)}, transformers says {getattr(hf, name)}"
    specials = [t for t in hf.special_tokens_map.values() if isinstance(t, str)]
    texts = list(TEXTS) + specials + [f"before{t}after {t} " for t in specials]
    for text in texts:
        for add in (True, False):
            ours, theirs = fast.encode(text, add_special_tokens=add), _ids(hf(text, add_special_tokens=add))
            if ours != theirs:
                return f"{text!r} encodes to {ours[:12]}..., transformers gives {theirs[:12]}..."
            for skip in (True, False):
                if fast.decode(ours, skip_special_tokens=skip) != hf.decode(ours, skip_special_tokens=skip):
                    return f"{ours[:12]}... decodes differently (skip_special_tokens={skip})"
    step = max(1, len(hf) // 997)
    for i in [*range(0, len(hf), step), *hf.all_special_ids, len(hf) - 1]:
        if fast.decode([i]) != hf.decode([i]):
            return f"token {i} decodes to {fast.decode([i])!r}, transformers gives {hf.decode([i])!r}"
    if (fast.chat_template is None) != (getattr(hf, "chat_template", None) is None):
        return "one has a chat template and the other not"
    if fast.chat_template is not None:
        for chat in CHATS:
            for add in (True, False):
                ours = _outcome(fast.apply_chat_template, chat, add_generation_prompt=add, tokenize=False)
                theirs = _outcome(hf.apply_chat_template, chat, add_generation_prompt=add, tokenize=False)
                if ours != theirs:
                    return f"the chat template renders {chat!r} as {ours!r}, transformers as {theirs!r}"
                ours = _outcome(fast.apply_chat_template, chat, add_generation_prompt=add, return_dict=False)
                theirs = _outcome(lambda c, a: _ids(hf.apply_chat_template(c, add_generation_prompt=a)), chat, add)
                if ours != theirs:
                    return f"the chat {chat!r} tokenizes differently through the template"
        for chat in TOOL_CHATS:
            ours = _outcome(fast.apply_chat_template, chat, tools=TOOLS, add_generation_prompt=True, tokenize=False)
            theirs = _outcome(hf.apply_chat_template, chat, tools=TOOLS, add_generation_prompt=True, tokenize=False)
            if ours != theirs:
                return f"the chat template renders {chat!r} with tools as {ours!r}, transformers as {theirs!r}"
    return None
