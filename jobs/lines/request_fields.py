"""Every body field a request line may carry, and what berth does with it (docs/request-fields.md).

A batch file written for OpenAI's Batch API or for ``vllm run-batch`` must mean the same thing to
berth, so no field is ignored in silence: a field berth implements is read by
``jobs.lines.batch_format``; a field that by its nature changes nothing here (who the caller is, a
storage or billing hint) is accepted when its type is right; a field that selects behaviour berth
has only at one value is accepted at that value and refused at any other; the deprecated
``functions`` and ``function_call`` are refused, pointing at ``tools`` (``jobs.lines.tools``); any other
name is refused as unknown, as OpenAI answers an unrecognised argument with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from jobs.lines.line_text import shown

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL)

_BOTH = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "seed", "logprobs",
    "min_tokens", "ignore_eos", "stream", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "logit_bias", "min_p", "cache_salt",
    # structured outputs (jobs.lines.structured_outputs reads them, and refuses the last three with a reason)
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "guided_json_object", "guided_whitespace_pattern", "structural_tag",
}
IMPLEMENTED = {
    CHAT_URL: _BOTH | {"messages", "max_completion_tokens", "top_logprobs",
                       "tools", "tool_choice", "parallel_tool_calls"},  # jobs.lines.tools reads the last three
    COMPLETIONS_URL: _BOTH | {"prompt"},
    EMBEDDINGS_URL: {"model", "input", "encoding_format", "dimensions"},
    # jobs.lines.responses_format reads the OpenAI fields and hands berth's sampling extensions on as a chat line's
    RESPONSES_URL: {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
                    "tool_choice", "parallel_tool_calls", "stream", "reasoning", "include",
                    "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "cache_salt"},
}
"""What ``jobs.lines.batch_format``, ``jobs.lines.structured_outputs``, ``jobs.lines.tools``,
``jobs.lines.embeddings_format`` and ``jobs.lines.responses_format`` read, per endpoint."""


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


NO_EFFECT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "user": (_is_str, "a string"),
    "safety_identifier": (_is_str, "a string"),
    "prompt_cache_key": (_is_str, "a string"),  # berth's prefix cache needs no key
    "request_id": (_is_str, "a string"),  # vLLM: names the request in its logs; berth names it by custom_id
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "store": (lambda v: isinstance(v, bool), "true or false"),
    "service_tier": (_is_str, "a string"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "prompt_cache_retention": (lambda v: v in ("in_memory", "24h"), '"in_memory" or "24h"'),  # berth's cache has one
}
"""Accepted and without effect by their nature (with the type they must have)."""

NO_EFFECT_ON = {EMBEDDINGS_URL: {"user", "request_id"},
                RESPONSES_URL: {"user", "safety_identifier", "prompt_cache_key", "metadata", "service_tier",
                                "stream_options", "prompt_cache_retention"}}
"""The endpoints where only some of ``NO_EFFECT`` are fields (the rest belong to generation); all elsewhere."""

ONLY = {  # name -> ({url: the one value berth runs}, why another value cannot be had)
    "echo": ({COMPLETIONS_URL: False}, "berth returns the completion without the prompt"),
    "suffix": ({COMPLETIONS_URL: None}, "berth does not insert (fill in the middle)"),
    "best_of": ({CHAT_URL: 1, COMPLETIONS_URL: 1}, "berth returns every sample it draws: use n"),  # n, in fact
    "use_beam_search": ({CHAT_URL: False, COMPLETIONS_URL: False}, "berth does not run beam search"),
    "length_penalty": ({CHAT_URL: 1, COMPLETIONS_URL: 1}, "it applies to beam search, which berth does not run"),
    "skip_special_tokens": ({CHAT_URL: True, COMPLETIONS_URL: True}, "berth's text leaves special tokens out"),
    "spaces_between_special_tokens": ({CHAT_URL: True, COMPLETIONS_URL: True}, "berth decodes with the default"),
    "include_stop_str_in_output": ({CHAT_URL: False, COMPLETIONS_URL: False},
                                   "berth's text ends before the stop string"),
    "add_generation_prompt": ({CHAT_URL: True}, "berth's chat template always opens the assistant's turn"),
    "continue_final_message": ({CHAT_URL: False}, "berth's chat template always opens a new assistant turn"),
    "add_special_tokens": ({CHAT_URL: False, COMPLETIONS_URL: True, EMBEDDINGS_URL: True},
                           "berth tokenizes with vLLM's default"),
    "return_tokens_as_token_ids": ({CHAT_URL: False, COMPLETIONS_URL: False}, "berth returns tokens as text"),
    "priority": ({CHAT_URL: 0, COMPLETIONS_URL: 0, EMBEDDINGS_URL: 0},
                 "a job's priority is set on the job (berth submit --priority)"),
    "modalities": ({CHAT_URL: ["text"]}, "berth generates text only"),
    # embeddings (vLLM's extra fields)
    "normalize": ({EMBEDDINGS_URL: True}, "berth's vectors are always of unit length"),
    "truncate_prompt_tokens": ({EMBEDDINGS_URL: None}, "berth does not cut inputs: one over the model's context "
                                                        "is a line error"),
    "embed_dtype": ({EMBEDDINGS_URL: "float32"}, "berth's vectors are float32, as numbers or as base64"),
    # the Responses API's
    "store": ({RESPONSES_URL: False}, "berth keeps no response to fetch later by its id: the answer is the reply, "
                                      "or the job's output line; set store to false or leave it out"),
    "background": ({RESPONSES_URL: False}, "berth answers /v1/responses now: for work in the background submit a "
                                           "batch of /v1/responses lines"),
    "truncation": ({RESPONSES_URL: "disabled"}, "berth does not cut the input: one over the model's context is "
                                                "refused"),
    "max_tool_calls": ({RESPONSES_URL: None}, "it bounds built-in tools, and berth runs function tools only"),
}
"""Accepted only at the value that is berth's behaviour (absent or null is that value too)."""

NOT_YET = {
    "functions": 'is deprecated for tools and berth does not read it: give each function as '
                 '{"type": "function", "function": {...}} in tools',
    "function_call": 'is deprecated for tool_choice and berth does not read it: use tool_choice ("none", "auto", '
                     '"required" or {"type": "function", "function": {"name": ...}})',
}


REFUSED_ON = {RESPONSES_URL: {
    "previous_response_id": "berth keeps no earlier responses to continue from: send the whole conversation in "
                            "input (earlier turns as messages, calls as function_call and function_call_output items)",
    "conversation": "berth keeps no conversations: send the whole conversation in input",
    "prompt": "berth keeps no saved prompts: write the prompt in instructions and input",
    "context_management": "berth keeps no conversation state to compact: send the input you want the model to see",
    "top_logprobs": "is not supported yet on /v1/responses: use a /v1/chat/completions line with logprobs",
}}
"""Fields of one endpoint refused by name, with what to do instead; not fields of any other endpoint."""


def _same(value: Any, want: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same number, true is not 1."""
    if isinstance(want, bool) or want is None or isinstance(value, bool):
        return value is want
    if isinstance(want, (int, float)):
        return isinstance(value, (int, float)) and value == want
    return type(value) is type(want) and value == want


def unknown_field(url: str, body: dict) -> tuple[str, str] | None:
    """The first field of ``body`` berth would ignore, as ``(param, why)``; None when there is none."""
    implemented = IMPLEMENTED[url]
    for name, value in body.items():
        if name in implemented:
            continue
        param = f"body.{name}"
        if name in NOT_YET:
            if value is None:
                continue
            return param, NOT_YET[name]
        if name in REFUSED_ON.get(url, {}):
            if value is None:
                continue
            return param, REFUSED_ON[url][name]
        if name in NO_EFFECT and name in NO_EFFECT_ON.get(url, NO_EFFECT):
            ok, what = NO_EFFECT[name]
            if value is not None and not ok(value):
                return param, f"must be {what}, got {shown(value)}"
            continue
        if name in ONLY and url in ONLY[name][0]:
            want, why = ONLY[name][0][url], ONLY[name][1]
            if name == "best_of":  # vLLM's default: as many as n, which returns them all
                want = body.get("n") if isinstance(body.get("n"), int) else 1
            if value is not None and not _same(value, want):
                return param, f"berth runs only {json.dumps(want)} here ({why}), got {shown(value)}"
            continue
        others = [u for u in URLS if u != url and (name in IMPLEMENTED[u] or (name in ONLY and u in ONLY[name][0])
                                                  or (name in NO_EFFECT and name in NO_EFFECT_ON.get(u, NO_EFFECT)))]
        if others:
            named = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
            return param, f"is a field of {named}, not of {url}"
        return param, ("is not a request field berth knows: berth refuses fields it would otherwise ignore "
                       "(docs/request-fields.md lists those it takes)")
    return None
