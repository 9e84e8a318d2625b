"""Issue 24's first slice: ``POST /v1/chat/completions`` and ``POST /v1/completions`` on ``berth serve``
(embedded defaults), driven by the unmodified openai client, whole and streamed; interactive requests
ahead of batch work in the scheduler; a caller that leaves frees its request's KV blocks."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from jobs.hosting.generate import generate_file
from tests.support.jobs_env import TINY_NAME, read_jsonl, request_line, tiny_settings
from tests.support.paths import ROOT
from tests.support.qwen import tool_line
from tests.support.serving import client, embedded_settings, key_for, serving, upload
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, SamplingParams, Sequence
from worker.engine.scheduler import Scheduler
from worker.engine.text_delta import TextDelta

DEADLINE = 120.0  # seconds: generous, the machine is loaded; the tests wait on conditions, never on time


def _until(condition, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.01)
    return found


def _batch(tmp_path, engine, lines: list[dict]) -> dict[str, dict]:
    """The batch results of ``lines`` (``berth generate``'s path, on the same engine), by custom_id."""
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    generate_file(path, tmp_path / "batch.out.jsonl", engine=engine, progress=False)
    return {line["custom_id"]: line["response"]["body"] for line in read_jsonl(tmp_path / "batch.out.jsonl")}


def _create(c: openai.OpenAI, url: str, body: dict, **kw):
    api = c.chat.completions if url == "/v1/chat/completions" else c.completions
    return api.create(**body, **kw)


def _streamed(c: openai.OpenAI, url: str, body: dict, **kw) -> tuple[list, str, str | None]:
    """The chunks of a streamed answer, its text put together, and the last choice's finish_reason."""
    chunks = list(_create(c, url, body, stream=True, **kw))
    chat = url == "/v1/chat/completions"
    text = "".join((ch.choices[0].delta.content or "") if chat else ch.choices[0].text
                   for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] is not None and not any(finishes[:-1]), finishes  # in the last choice chunk only
    return chunks, text, finishes[-1]


def _text(url: str, choice) -> str:
    return choice.message.content if url == "/v1/chat/completions" else choice.text


def _body_text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_whole_and_streamed_answers_equal_the_batch_result(tmp_path, tiny_llama_dir, tiny_engine):
    """Greedy chat and completions, whole and streamed, with a stop string cut in the middle of the text:
    the text, finish reason and usage of the batch result; the usage chunk equals the whole answer's."""
    lines = [request_line(i, max_tokens=24) for i in (0, 1)]
    plain = _batch(tmp_path, tiny_engine, lines)
    for line in list(lines):  # a stop string from the middle of each text: the result ends where it begins
        text = _body_text(plain[line["custom_id"]])
        assert len(text) > 12, text
        lines.append({**line, "custom_id": line["custom_id"] + "-stop", "body": {**line["body"], "stop": [text[8:11]]}})
    expected = _batch(tmp_path, tiny_engine, lines)
    for stopped in lines[2:]:
        assert len(_body_text(expected[stopped["custom_id"]])) <= 8
        assert expected[stopped["custom_id"]]["choices"][0]["finish_reason"] == "stop"
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        for line in lines:
            url, body, want = line["url"], line["body"], expected[line["custom_id"]]
            want_text = _body_text(want)
            whole = _create(c, url, body)
            assert whole.object == want["object"]
            assert [_text(url, ch) for ch in whole.choices] == [want_text]
            assert whole.choices[0].finish_reason == want["choices"][0]["finish_reason"]
            assert whole.usage.model_dump(exclude={"prompt_tokens_details", "completion_tokens_details"}) == {
                k: v for k, v in want["usage"].items() if k != "prompt_tokens_details"}

            chunks, text, finish = _streamed(c, url, body, stream_options={"include_usage": True})
            assert (text, finish) == (want_text, want["choices"][0]["finish_reason"]), line["custom_id"]
            if url == "/v1/chat/completions":
                assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
            else:
                assert chunks[0].object == "text_completion"
            assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(
                exclude={"prompt_tokens_details", "completion_tokens_details"}) == whole.usage.model_dump(
                exclude={"prompt_tokens_details", "completion_tokens_details"})
            assert all(ch.usage is None for ch in chunks[:-1])
            _, text, finish = _streamed(c, url, body)  # without usage: no usage chunk
            assert text == want_text


def test_samples_and_logprobs_stream_as_the_batch_has_them(tmp_path, tiny_llama_dir, tiny_engine):
    """n = 3 sampled with a seed, with logprobs: each choice's pieces and logprobs entries, put together
    by index, are the batch result's choice."""
    body = {**request_line(0, max_tokens=12)["body"], "n": 3, "temperature": 0.9, "seed": 11, "logprobs": True,
            "top_logprobs": 2}
    want = _batch(tmp_path, tiny_engine, [{"custom_id": "n", "method": "POST", "url": "/v1/chat/completions",
                                            "body": body}])["n"]["choices"]
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        chunks = list(c.chat.completions.create(**body, stream=True))
        whole = c.chat.completions.create(**body)
    texts, logprobs, finish = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).extend(e.model_dump() for e in choice.logprobs.content)
            if choice.finish_reason:
                assert choice.index not in finish
                finish[choice.index] = choice.finish_reason
    assert [texts[c["index"]] for c in want] == [c["message"]["content"] for c in want]
    assert len(set(texts.values())) > 1  # the samples differ: each stream is its own
    assert [finish[c["index"]] for c in want] == [c["finish_reason"] for c in want]
    assert [logprobs[c["index"]] for c in want] == [c["logprobs"]["content"] for c in want]
    assert [ch.model_dump()["message"]["content"] for ch in whole.choices] == [c["message"]["content"] for c in want]


def test_a_required_tool_call_streams_as_one_tool_calls_chunk(tmp_path, qwen_dir, qwen_engine):
    """With tools the answer comes whole at the end: the batch result's calls as ``delta.tool_calls``."""
    line = tool_line(0, "Weather in Oslo?", tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    line["body"]["model"] = TINY_NAME
    want = _batch(tmp_path, qwen_engine, [line])["t0"]["choices"][0]
    assert want["finish_reason"] == "tool_calls"
    settings = tiny_settings(qwen_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    with serving(settings, engine=qwen_engine) as server:
        c = client(server, key_for(settings, "alice"))
        chunks = [ch for ch in c.chat.completions.create(**line["body"], stream=True) if ch.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = chunks[-1].choices[0].delta.tool_calls
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in calls] == [
        (k, "function", t["function"]["name"], t["function"]["arguments"])
        for k, t in enumerate(want["message"]["tool_calls"])]
    assert all(t.id.startswith("call_") for t in calls)


def test_the_default_model_streams_real_text_equal_to_its_batch_result(tmp_path, smol_path):
    """The default model (SmolLM2): real text, with characters of several bytes that tokens split."""
    from worker.config import Settings
    from worker.engine.engine import Engine

    settings = Settings(model=smol_path, model_name="smol", kv_memory="32MiB", threads=1, max_num_seqs=4,
                        database_url=f"sqlite:///{tmp_path / 'berth.db'}", storage_url=f"file://{tmp_path / 'store'}")
    engine = Engine(settings)
    body = {"model": "smol", "messages": [{"role": "user", "content": "Write a greeting in Japanese and Greek."}],
            "max_tokens": 40, "temperature": 0}
    line = {"custom_id": "real", "method": "POST", "url": "/v1/chat/completions", "body": body}
    want = _batch(tmp_path, engine, [line])["real"]["choices"][0]["message"]["content"]
    with serving(settings, engine=engine) as server:
        c = client(server, key_for(settings, "alice"))
        chunks, text, _ = _streamed(c, "/v1/chat/completions", body)
    assert text == want and not want.isascii(), want  # real text, with characters of more than one byte
    assert not any("\ufffd" in (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)


def test_text_deltas_hold_back_split_characters_and_possible_stop_strings(smol_tokenizer):
    text = "Grüße, 世界! 🎉 done. END of it"
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextDelta(smol_tokenizer)
    pieces = [stream.advance(ids[:k]) for k in range(1, len(ids) + 1)]
    assert "".join(pieces) + stream.finish(text) == text
    assert not any("\ufffd" in p for p in pieces)
    assert any(len(smol_tokenizer.decode(ids[:k])) and smol_tokenizer.decode(ids[:k]).endswith("\ufffd")
               for k in range(1, len(ids)))  # the text does split a character between tokens

    stream = TextDelta(smol_tokenizer, stop=("END",))
    cut = text[:text.index("END")]
    sent = ""
    for k in range(1, len(ids) + 1):
        if "END" in smol_tokenizer.decode(ids[:k]):
            break  # the engine ends the sample at the token that completes a stop string: then ``finish``
        sent += stream.advance(ids[:k])
        assert cut.startswith(sent)
    assert len(sent) >= len("Grüße, 世界! 🎉 do")  # held back no more than a stop string's length
    assert sent + stream.finish(cut) == cut


def test_a_caller_that_leaves_mid_stream_frees_its_kv_blocks(tmp_path, tiny_llama_dir, tiny_engine):
    idle = tiny_engine.block_manager.num_free_blocks
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    max_tokens = 1800
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        before = tiny_engine.stats.output_tokens
        stream = c.completions.create(model=TINY_NAME, prompt="Once upon a time", max_tokens=max_tokens,
                                      temperature=0, extra_body={"ignore_eos": True}, stream=True)
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        assert tiny_engine.block_manager.num_free_blocks < idle  # its blocks are held while it runs
        stream.close()  # the caller leaves
        _until(lambda: not tiny_engine.has_unfinished() and tiny_engine.block_manager.num_free_blocks == idle,
               "the request's blocks back on the free list")
        assert tiny_engine.stats.output_tokens - before < max_tokens  # aborted, not run to its end


def test_a_caller_that_leaves_before_its_whole_answer_frees_its_kv_blocks(tmp_path, tiny_llama_dir, tiny_engine):
    """``stream: false``: the caller closes its connection while the request runs; the engine drops it."""
    idle = tiny_engine.block_manager.num_free_blocks
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    max_tokens = 1800
    with serving(settings, engine=tiny_engine) as server:
        key = key_for(settings, "alice")
        before = tiny_engine.stats.output_tokens
        body = json.dumps({"model": TINY_NAME, "prompt": "Once", "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            _until(lambda: tiny_engine.stats.output_tokens > before, "the request generating")
        _until(lambda: not tiny_engine.has_unfinished() and tiny_engine.block_manager.num_free_blocks == idle,
               "the request's blocks back on the free list")
        assert tiny_engine.stats.output_tokens - before < max_tokens  # aborted, not run to its end


def test_the_readme_streaming_snippet_talks_to_berth_serve(tmp_path, tiny_llama_dir):
    """The Quick start's second Python block, as written, against the tiny model under the default name."""

    from worker.config import DEFAULT_MODEL_NAME, Settings

    readme = ROOT.joinpath("README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    snippet = section.split("```python\n")[2].split("\n```", 1)[0]
    assert "stream=True" in snippet
    settings = Settings(model=str(tiny_llama_dir), model_name=DEFAULT_MODEL_NAME, kv_memory="64MiB", threads=1,
                        database_url=f"sqlite:///{tmp_path / 'berth.db'}", storage_url=f"file://{tmp_path / 's'}")
    with serving(settings) as server:
        exec(snippet.replace("http://127.0.0.1:8000", server.url).replace("berth-...", key_for(settings, "me")), {})


def test_bad_bodies_get_openais_error_objects(tmp_path, tiny_llama_dir, tiny_engine):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = [  # (url, body, the param named)
        ("/v1/chat/completions", {"model": TINY_NAME}, "messages"),
        ("/v1/chat/completions", {**chat, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {**chat, "frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {**chat, "n": 17}, "n"),
        ("/v1/chat/completions", {**chat, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),
        ("/v1/chat/completions", {**chat, "model": "gpt-4o"}, "model"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/completions", {"model": TINY_NAME, "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": TINY_NAME, "messages": chat["messages"]}, "messages"),
    ]
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key)
        for url, body, param in bad:
            with pytest.raises(openai.BadRequestError) as raised:
                c.post(url.removeprefix("/v1"), body=body, cast_to=object)
            error = raised.value.body
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param, (url, body, error)
        for raw in (b"not json", b"[1, 2]", b'{"model": '):
            asked = urllib.request.Request(f"{server.url}/v1/chat/completions", data=raw, method="POST", headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(asked, timeout=60)
            assert raised.value.code == 400
            assert set(json.loads(raised.value.read())["error"]) == {"message", "type", "param", "code"}
        with pytest.raises(openai.AuthenticationError) as raised:
            client(server, "berth-not-a-key").chat.completions.create(**chat)
        assert raised.value.body["code"] == "invalid_api_key"
        assert c.chat.completions.create(**chat).choices[0].message.role == "assistant"  # the server is well


def test_an_interactive_request_runs_before_the_batch_work_that_fills_the_worker(tmp_path, tiny_llama_dir):
    """Four long batch lines hold every seat (max_num_seqs 4) of one tenant; the same tenant's streamed
    request gets its first token while all four still run (not one of them has finished): it took a
    seat from batch work rather than waiting for one."""
    from worker.engine.engine import Engine

    engine = Engine(tiny_settings(tiny_llama_dir, max_num_seqs=4))
    settings = embedded_settings(tiny_llama_dir, tmp_path, max_num_seqs=4)
    path = tmp_path / "long.jsonl"
    lines = []
    for i in range(4):
        line = request_line(i, max_tokens=1500)
        line["body"]["ignore_eos"] = True
        lines.append(line)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with serving(settings, engine=engine) as server:
        c = client(server, key_for(settings, "alice"))
        batch = c.batches.create(input_file_id=upload(c, path).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        _until(lambda: engine.num_running == 4, "the batch holding every seat")
        stream = c.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "Quick!"}],
                                           max_tokens=3, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                break
        counts = c.batches.retrieve(batch.id).request_counts
        assert counts.completed == 0 and counts.failed == 0, counts
        stream.close()
        c.batches.cancel(batch.id)


# ---- the scheduler, without a model
def _seq(i: int, prompt: int, tenant: str = "t", interactive: bool = False) -> Sequence:
    request = Request(str(i), [i * 1000 + j for j in range(prompt)], SamplingParams(max_tokens=64), tenant=tenant)
    request.interactive = interactive
    seq = Sequence(request=request, sample_index=0, token_ids=list(request.prompt_token_ids), num_prompt_tokens=prompt)
    request.sequences.append(seq)
    return seq


def _decode(plan) -> None:
    """The model's part of a step: the scheduled tokens are computed, a decoded one gets a new token."""
    for seq, n in plan.scheduled:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_interactive_sequence_preempts_batch_work_for_kv_blocks_and_a_seat(mode):
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=2, preemption_mode=mode)
    batch = [_seq(0, 15), _seq(1, 15)]  # 4 blocks each: every block and every seat
    for s in batch:
        sched.add(s)
    _decode(sched.schedule())
    assert set(sched.running) == set(batch) and bm.num_free_blocks == 0
    waiting_batch = _seq(2, 4)
    sched.add(waiting_batch)
    _decode(sched.schedule())
    assert waiting_batch not in sched.running  # batch work waits for batch work

    live = _seq(3, 6, interactive=True)
    sched.add(live)
    plan = sched.schedule()
    assert (live, 6) in plan.scheduled and live in sched.running
    assert plan.preempted and all(not s.request.interactive for s in plan.preempted)
    assert waiting_batch not in sched.running  # a step that preempted batch work admits no batch work


def test_interactive_tenants_share_by_weight_and_batch_gets_what_is_left():
    bm = BlockManager(num_blocks=256, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=30, max_num_seqs=16)
    sched.shares.update({"a": 2.0, "b": 1.0})
    live = [_seq(i, 60, tenant="a" if i < 2 else "b", interactive=True) for i in range(4)]
    batch = _seq(9, 60, tenant="a")
    for s in [batch, *live]:
        sched.add(s)
    plan = sched.schedule()
    given = {s.request.request_id: n for s, n in plan.scheduled}
    assert "9" not in given  # the interactive prompts took the whole budget
    by_tenant = {t: sum(n for s, n in plan.scheduled if s.request.tenant == t) for t in ("a", "b")}
    assert by_tenant == {"a": 20, "b": 10}


def test_seats_held_for_interactive_work_are_never_taken_by_batch_work(monkeypatch, tiny_llama_dir):
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_cache=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4, interactive_seats=2)
    batch = [_seq(i, 5) for i in range(4)]
    for s in batch:
        sched.add(s)
    _decode(sched.schedule())
    assert len(sched.running) == 2  # two seats held
    live = [_seq(10 + i, 5, interactive=True) for i in range(3)]
    for s in live[:2]:
        sched.add(s)
    plan = sched.schedule()
    assert not plan.preempted and set(live[:2]) <= set(sched.running)  # the held seats, no preemption
    _decode(plan)
    sched.add(live[2])
    plan = sched.schedule()  # a third takes a batch sequence's seat
    assert live[2] in sched.running and [s.request.interactive for s in plan.preempted] == [False]

    monkeypatch.setenv("BERTH_INTERACTIVE_SEATS", "0.5")  # the setting, end to end: the environment to the engine
    from worker.config import Settings
    from worker.engine.engine import Engine

    assert Settings().interactive_seats == 0.5
    engine = Engine(tiny_settings(tiny_llama_dir, max_num_seqs=8))
    assert engine.scheduler.interactive_seats == 4
    with pytest.raises(ValueError):
        Settings(interactive_seats=1)
