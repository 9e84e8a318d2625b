"""The answer to ``POST /v1/responses``: the whole Response, or OpenAI's server-sent events of one.

A stream opens with ``response.created`` and ``response.in_progress`` (the Response "in_progress", no
output yet), then for a text answer a ``message`` item and its ``output_text`` part are added and the text
comes as ``response.output_text.delta`` events as the engine makes it; at the end ``output_text.done``,
``content_part.done``, ``output_item.done`` and ``response.completed`` (``response.incomplete`` where
``max_output_tokens`` cut it) with the whole Response, usage included. Each event is ``event: <type>`` and
its JSON, with ``type`` and a ``sequence_number`` counting from 0, as the openai package's
``ResponseStreamEvent`` types read them. A request with tools is read for calls only once it ends (as on
the chat route), so its items, text or ``function_call`` with its arguments, all come then. A failure
after the stream began is an ``error`` event, and the stream ends.
"""

from __future__ import annotations

import json
import time

from jobs.lines.batch_format import BatchLine, response_line
from jobs.lines.responses_format import response_object, text_part
from jobs.lines.validate import ModelInfo
from worker.consumer.interactive_inbox import Delta, Failed


class ResponsesReply:
    """One request's answer as the Responses API writes it: ``line`` is the request as asked (its
    fields echoed), ``tool_calls`` the format its calls are read in (None: plain text)."""

    def __init__(self, line: BatchLine, tool_calls: str | None, info: ModelInfo, stream: bool):
        self.line, self.tool_calls, self.info, self.stream = line, tool_calls, info, stream
        self.created = int(time.time())
        self.request_id = ""
        self.sequence = 0
        self.text: list[str] = []

    def body(self, output) -> dict:
        body = response_line(self.line, output, self.info.name, self.info.tokenizer, self.tool_calls)
        return {**body["response"]["body"], "created_at": self.created}

    def _event(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    def _item(self, index: int = 0) -> dict:
        return {"item_id": f"msg_{self.request_id}", "output_index": index, "content_index": 0}

    def first(self, request_id: str) -> list[bytes]:
        self.request_id = request_id
        shown = response_object(self.line.body, request_id, self.info.name, "in_progress", [], None, self.created)
        out = [self._event("response.created", response=shown), self._event("response.in_progress", response=shown)]
        if self.tool_calls is None:  # text: its item opens now, its pieces follow as they come
            out += self._opened({"type": "message", "id": f"msg_{request_id}", "role": "assistant",
                                 "status": "in_progress", "content": []}, 0)
        return out

    def _opened(self, item: dict, index: int) -> list[bytes]:
        out = [self._event("response.output_item.added", output_index=index, item=item)]
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", **self._item(index), part=text_part("")))
        return out

    def deltas(self, d: Delta) -> list[bytes]:
        if self.tool_calls is not None or not d.text:
            return []
        self.text.append(d.text)
        return [self._event("response.output_text.delta", **self._item(), delta=d.text, logprobs=[])]

    def done(self, output) -> list[bytes]:
        body = self.body(output)
        out = []
        for index, item in enumerate(body["output"]):
            if self.tool_calls is not None:
                out += self._opened({**item, "status": "in_progress", **({"content": []} if item["type"] == "message"
                                                                         else {"arguments": ""})}, index)
            out += self._closed(item, index)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=body)]

    def _closed(self, item: dict, index: int) -> list[bytes]:
        if item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": index}
            return [self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        text = item["content"][0]["text"]
        out = []
        if self.tool_calls is not None and text:  # nothing streamed before: the text in one piece
            out.append(self._event("response.output_text.delta", **self._item(index), delta=text, logprobs=[]))
        return out + [self._event("response.output_text.done", **self._item(index), text=text, logprobs=[]),
                      self._event("response.content_part.done", **self._item(index), part=item["content"][0]),
                      self._event("response.output_item.done", output_index=index, item=item)]

    def failed(self, failed: Failed) -> list[bytes]:
        return [self._event("error", code=failed.code, message=failed.reason, param=None)]
