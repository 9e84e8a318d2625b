"""A tiny random Qwen3 that calls tools in Qwen's ``<tool_call>`` format (fixtures ``qwen_dir`` and
``qwen_engine``), the tools it is offered, and a chat line that offers them."""

from __future__ import annotations

import pytest

from tests.support.jobs_env import tiny_settings
from tests.support.models import save_tiny_model
from worker.engine.engine import Engine

CHAT = "/v1/chat/completions"
# Written after Qwen2.5's template: the tools as JSON lines in <tools>, calls as <tool_call> blocks,
# a tool's answer as a <tool_response> in a user turn.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
CONVERT = {"type": "object", "properties": {"to": {"type": "string", "enum": ["EUR", "USD", "NOK"]},
                                            "exact": {"type": "boolean"}}, "required": ["to", "exact"]}
LOOKUP = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["id"]}
SCHEMAS = {"get_weather": WEATHER, "convert": CONVERT, "lookup": LOOKUP}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smol_tokenizer):
    """A random 2-layer Qwen3 with the default model's vocabulary, <tool_call> and </tool_call> added
    as plain (not special) tokens as in Qwen's, and the Qwen-style template above."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    base = tmp_path_factory.mktemp("qwen-tokenizer")
    smol_tokenizer.save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return save_tiny_model(Qwen3Config, Qwen3ForCausalLM, tokenizer, tmp_path_factory.mktemp("tiny-qwen3"),
                           tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen_engine(qwen_dir):
    return Engine(tiny_settings(qwen_dir))


def tool_line(i: int, content: str, **body) -> dict:
    """A chat line offering ``TOOLS``, greedy."""
    return {"custom_id": f"t{i}", "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], "tools": TOOLS, "temperature": 0, **body}}
