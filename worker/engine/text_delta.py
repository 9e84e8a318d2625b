"""A running sample's text, given out a piece at a time, that adds up to its finished result's text.

    stream = TextDelta(tokenizer, params.stop)
    piece = stream.advance(seq.output_token_ids)        # after each step: text safe to show now
    rest = stream.finish(final_text)                    # once the sample ends: the rest of its text

Two things are held back until they are certain:

- a character whose bytes are split across tokens: a byte-level tokenizer decodes a prefix that ends
  inside one as U+FFFD, so the newest tokens are decoded together with the ones before them (vLLM's
  prefix and read offsets) and nothing is given out while the decoded tail ends in U+FFFD;
- the last ``len(longest stop string) - 1`` characters: they may be the start of a stop string,
  and the result's text ends where a stop string begins (``Engine.final_text``).

The finished text comes from the engine (``Engine.final_text``, the text a batch result holds); the
pieces given out before are always a prefix of it, so ``finish`` gives the rest, and the pieces add
up to exactly the batch result's text. Decoding costs a few tokens a step, not the whole output.
"""

from __future__ import annotations

import logging

log = logging.getLogger("berth.engine")

REPLACEMENT = "\ufffd"


class TextDelta:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.hold = max(map(len, stop), default=1) - 1
        self.decoded = ""  # text of the tokens up to ``read``
        self.sent = 0  # characters of ``decoded`` given out
        self.prefix = self.read = 0  # token offsets: decode [prefix, end) and keep what [prefix, read) lacks
        self.tokens = 0  # output tokens seen

    def advance(self, output_ids: list[int]) -> str:
        """The text that is certain now that the sample has ``output_ids``."""
        self.tokens = len(output_ids)
        if self.read < len(output_ids):
            before = self._decode(output_ids[self.prefix:self.read])
            after = self._decode(output_ids[self.prefix:])
            if len(after) > len(before) and not after.endswith(REPLACEMENT) and after.startswith(before):
                self.decoded += after[len(before):]
                self.prefix, self.read = self.read, len(output_ids)
        end = len(self.decoded) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = self.decoded[self.sent:end], end
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the sample's text, now that it has ended with ``final_text``."""
        sent = self.decoded[:self.sent]
        if not final_text.startswith(sent):  # a tokenizer whose decoding is not prefix-stable: said, not hidden
            log.warning("a streamed text diverged from its final text after %d characters", len(sent))
            return final_text[len(sent):] if len(final_text) > len(sent) else ""
        self.sent = len(final_text)
        self.decoded = final_text
        return final_text[len(sent):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
