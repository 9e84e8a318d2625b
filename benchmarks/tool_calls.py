"""Tool calls on the default model: how many answers are valid calls, how often "required" picks the
function the question is about, and the decode rate, with the tools described in the system message
(what berth does for a template that does not take tools) and without (the template alone).

    python -m benchmarks.tool_calls            # figures in benchmarks/README.md, "Tool calls"
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import jsonschema

from jobs.hosting.generate import generate_file
from jobs.lines import batch_format
from worker.config import Settings
from worker.engine.engine import Engine

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                    "required": ["city", "days"]},
    "convert_currency": {"type": "object", "properties": {"amount": {"type": "number"},
                                                          "to": {"type": "string", "enum": ["EUR", "USD", "GBP"]}},
                         "required": ["amount", "to"]},
    "send_email": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 60},
                                                    "subject": {"type": "string", "maxLength": 60}},
                   "required": ["to", "subject"]},
}
DESCRIPTIONS = {"get_weather": "The weather forecast for a city", "convert_currency": "Convert an amount of money",
                "send_email": "Send an email"}
QUESTIONS = [
    ("get_weather", "What will the weather be in Paris over the next 3 days?"),
    ("get_weather", "Is it going to rain in London tomorrow?"),
    ("get_weather", "Forecast for Tokyo this week, please."),
    ("get_weather", "How warm will Madrid be in 2 days?"),
    ("convert_currency", "How much is 100 dollars in euros?"),
    ("convert_currency", "Convert 50 pounds to US dollars."),
    ("convert_currency", "I have 20 EUR, what is that in GBP?"),
    ("convert_currency", "Change 1000 USD into euros."),
    ("send_email", "Email bob@example.com that the meeting moved to Friday."),
    ("send_email", "Send alice@example.com a note titled 'Lunch'."),
    ("send_email", "Write to ops@example.com: server is down."),
    ("send_email", "Mail carol@example.com with subject 'Invoice'."),
]
TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
         for n, s in SCHEMAS.items()]


def lines() -> list[dict]:
    out = []
    for i, (want, question) in enumerate(QUESTIONS):
        for choice in ("required", {"type": "function", "function": {"name": want}}):
            out.append({"custom_id": f"{i}-{'named' if isinstance(choice, dict) else 'required'}-{want}",
                        "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": question}], "tools": TOOLS,
                                 "tool_choice": choice, "max_tokens": 96, "temperature": 0}})
    return out


def measure(engine: Engine, describe: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in lines()))
        keep = batch_format.for_template

        def plain(messages, tools, template):
            return keep(messages, None, template)

        with mock.patch.object(batch_format, "for_template", keep if describe else plain):
            start = time.perf_counter()
            summary = generate_file(src, out, engine=engine, progress=False)
            seconds = time.perf_counter() - start
        answers = [json.loads(x) for x in out.read_text().splitlines()]
    valid = picked = required = 0
    for a in answers:
        choice = a["response"]["body"]["choices"][0]
        want = a["custom_id"].split("-", 2)[2]
        if choice["finish_reason"] != "tool_calls":
            continue
        (call,) = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
            valid += 1
        except jsonschema.ValidationError:
            pass
        if "-required-" in a["custom_id"]:
            required += 1
            picked += name == want
    return {"describe": describe, "lines": len(answers), "valid_calls": valid,
            "required_picked_right": f"{picked}/{len(QUESTIONS)}", "output_tokens": summary.output_tokens,
            "seconds": round(seconds, 1), "tokens_per_s": round(summary.output_tokens / seconds, 1)}


def main() -> None:
    engine = Engine(Settings(threads=2, kv_memory="128MiB"))
    for describe in (True, False):
        print(json.dumps(measure(engine, describe)))


if __name__ == "__main__":
    main()
