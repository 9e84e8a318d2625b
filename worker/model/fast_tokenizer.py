"""A tokenizer read with the ``tokenizers`` library and jinja2 alone, as transformers saved it.

transformers' tokenizer is the reference, but importing it costs about a second at every start of
a worker or of ``berth generate``, and a restarted worker pays it again. ``worker.model.tokenizer``
loads a model's tokenizer through transformers once, saves it, and checks this class against it;
from then on this class reads the saved files (``tokenizer.json`` and berth's manifest of the facts
transformers derived: special tokens, ids, chat template, decoding cleanup) in milliseconds.

It offers the part of transformers' interface berth uses: ``len``, ``encode``/``__call__``,
``decode``, ``apply_chat_template``, the special token ids, ``get_vocab``, ``save_pretrained``, and
``transformers()`` for a caller that needs transformers' own object, loaded on first use
(structured outputs build xgrammar's tokenizer info from ``facts["grammar"]`` instead).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import tokenizers

from worker.model import chat_template

MANIFEST = "berth-tokenizer.json"
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # transformers' clean_up_tokenization, in order


class FastTokenizer:
    def __init__(self, folder: Path, backend: tokenizers.Tokenizer, facts: dict, transformers_source: str):
        self.name_or_path = str(folder)
        self.backend = backend
        self.facts = facts
        self.chat_template: str | None = facts["chat_template"]
        self.special_tokens_map: dict[str, str] = facts["special_tokens_map"]
        self.bos_token_id: int | None = facts["bos_token_id"]
        self.eos_token_id: int | None = facts["eos_token_id"]
        self.pad_token_id: int | None = facts["pad_token_id"]
        self.all_special_ids: list[int] = facts["all_special_ids"]
        self._clean_up = bool(facts["clean_up_tokenization_spaces"])
        self._length = backend.get_vocab_size(with_added_tokens=True)
        self._transformers_source = transformers_source
        self._transformers = None
        self._lock = threading.Lock()

    @classmethod
    def read(cls, folder: Path, facts: dict | None = None, transformers_source: str | None = None) -> FastTokenizer:
        """The tokenizer saved in ``folder``; ``facts`` default to its manifest."""
        if facts is None:
            facts = json.loads((folder / MANIFEST).read_text())["facts"]
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        return cls(folder, backend, facts, transformers_source or str(folder))

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, {self._length} tokens)"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, tools: list[dict] | None = None):
        """The prompt for ``messages`` (and ``tools``): its text with ``tokenize=False``, else
        ``{"input_ids": ids}``, or the ids alone with ``return_dict=False`` (transformers' defaults)."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template: send a `prompt` (completions) instead")
        text = chat_template.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens_map, tools=tools)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    def save_pretrained(self, folder) -> None:
        """The files transformers wrote, so that transformers (or this class) reads the same tokenizer there."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for f in Path(self.name_or_path).iterdir():
            if f.is_file() and f.name != MANIFEST:
                shutil.copyfile(f, folder / f.name)

    def transformers(self):
        """transformers' own tokenizer of the same files, loaded once, on first use."""
        with self._lock:
            if self._transformers is None:
                from transformers import AutoTokenizer

                self._transformers = AutoTokenizer.from_pretrained(self._transformers_source)
            return self._transformers
