"""`berth generate` end to end: good lines answered in input order, bad lines reported precisely."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from jobs.cli import main
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams


def chat(custom_id, content, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
                                "max_tokens": 6, "temperature": 0, **body}})


def test_generate_cli_orders_outputs_and_reports_bad_lines(tmp_path):
    lines = [
        chat("a", "What is 2+2?"),
        "{not json",
        chat("b", "Name a colour.", n=2, temperature=0.7, seed=1),
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 5,
                             "logprobs": 2}}),
        chat("a", "duplicate id"),
        chat("d", "wrong model", model="gpt-9"),
        chat("e", "bad temperature", temperature="hot"),
        json.dumps({"custom_id": "f", "method": "POST", "url": "/v1/rerank", "body": {}}),
        chat("g", "too long", max_tokens=100000),
        "",
        chat("h", "last one"),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["generate", str(src), "-o", str(out), "--quiet", "--kv-memory", "256MiB"])
    assert result.exit_code == 0, result.output
    answered = [json.loads(x) for x in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answered] == ["a", "b", "c", "h"]
    b = answered[1]["response"]["body"]
    assert [c["index"] for c in b["choices"]] == [0, 1]
    assert 2 <= b["usage"]["completion_tokens"] <= 12
    c = answered[2]["response"]["body"]["choices"][0]
    assert c["text"] and len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"]) <= 5
    errors = {e["error"]["line"]: e["error"]
              for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert set(errors) == {2, 5, 6, 7, 8, 9}
    assert "not valid JSON" in errors[2]["message"]
    assert "duplicate custom_id" in errors[5]["message"]
    assert errors[6]["code"] == "model_not_found"
    assert errors[7]["param"] == "body.temperature"
    assert errors[8]["param"] == "url"
    assert errors[9]["code"] == "context_length_exceeded"


def test_bfloat16_engine_tracks_float32(smol_loaded, text_ids):
    prompts = [text_ids[i * 500: i * 500 + 40] for i in range(8)]
    rows = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(loaded=smol_loaded, dtype=dtype, kv_memory="256MiB")
        captured = []
        original = engine._sampling_rows
        engine._sampling_rows = (lambda logits, samplers, scheduler, captured=captured, original=original:
                                 (captured.append(logits.clone()), original(logits, samplers, scheduler))[1])
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
        rows[dtype] = torch.cat(captured)
    agree = (rows["float32"].argmax(-1) == rows["bfloat16"].argmax(-1)).float().mean().item()
    assert agree >= 0.75, f"bfloat16 picks the float32 token only {agree:.0%} of the time"
    assert (rows["float32"] - rows["bfloat16"]).abs().max().item() < 2.0
