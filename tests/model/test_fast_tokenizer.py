"""berth's own tokenizer reader (``tokenizers`` and jinja2, no transformers) against transformers'.

A model's tokenizer is converted by transformers once and checked then; after that a start reads
it without importing transformers. These tests hold the reader to transformers on texts and chats
the check never saw, on chat templates that use what real ones use, and on a WordPiece tokenizer
whose decoding cleans up spaces; and they show the fallback to transformers where the check fails.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from worker.model.fast_tokenizer import MANIFEST, FastTokenizer
from worker.model.tokenizer import load_tokenizer

QWEN_LIKE_TEMPLATE = """
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] | trim + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant (' + bos_token + ').<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0, last='') %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{%- continue %}{%- endif %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant, not ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{% endgeneration %}
    {%- else %}{{ message.content }}{% endif %}
    {%- if message.name is defined %}{{ ' ' + dict(name=message.name) | tojson }}{% endif %}
    {{- '<|im_end|>\\n' }}
    {%- if loop.index > 50 %}{%- break %}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{{- '' if ns.turns < 3 else '<!-- ' + (messages | map(attribute='role') | list | tojson) + ' -->' }}
"""

CHATS = [
    [{"role": "user", "content": "Ünïcode 日本語 <b>tags</b> & \"quotes\""}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi", "name": "ann"},
     {"role": "assistant", "content": "  Hello!  "}, {"role": "user", "content": "Again\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]


def _texts(seed: int, n: int) -> list[str]:
    """Random strings over scripts, digits, whitespace, punctuation and the special tokens."""
    rng = random.Random(seed)
    pieces = ["the", " quick", "Über", "日本", "語", "🚀", "👍🏽", " ", "  ", "\n", "\t", "123", "4.5", "'s", "n't",
              ",", ".", "?", "!", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "é", "e\u0301", "ß", "Ж", "ع",
              "{", "}", '"', "\\", "x", "_", "def ", "    ", "\r\n", "\u200b", "ﬁ", "Ⅻ"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def smol_transformers(smol_tokenizer):
    return smol_tokenizer.transformers()


def test_the_default_model_reads_as_transformers_does(smol_tokenizer, smol_transformers):
    assert isinstance(smol_tokenizer, FastTokenizer)
    assert len(smol_tokenizer) == len(smol_transformers) == 49152
    for text in _texts(1, 300):
        ids = smol_tokenizer(text)["input_ids"]
        assert ids == smol_transformers(text)["input_ids"], text
        for skip in (True, False):
            assert smol_tokenizer.decode(ids, skip_special_tokens=skip) == \
                   smol_transformers.decode(ids, skip_special_tokens=skip), text
    for chat in CHATS:
        for add in (True, False):
            assert smol_tokenizer.apply_chat_template(chat, add_generation_prompt=add, tokenize=False) == \
                   smol_transformers.apply_chat_template(chat, add_generation_prompt=add, tokenize=False)
            assert smol_tokenizer.apply_chat_template(chat, add_generation_prompt=add, return_dict=False) == \
                   list(smol_transformers.apply_chat_template(chat, add_generation_prompt=add)["input_ids"])


def test_a_start_reads_the_cached_tokenizer_without_transformers(smol_tokenizer, smol_path):
    code = ("import sys; from worker.model.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({smol_path!r}); "
            "print(type(t).__name__, 'transformers' in sys.modules, "
            "t.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True)['input_ids'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 2)
    assert out[:2] == ["FastTokenizer", "False"]
    assert json.loads(out[2]) == smol_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                                   add_generation_prompt=True, return_dict=False)


def test_a_template_with_namespaces_loops_and_generation_tags_renders_as_transformers(
        tmp_path, monkeypatch, smol_transformers):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    smol_transformers.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder))
    ours = load_tokenizer(str(folder))
    assert isinstance(ours, FastTokenizer), "the check should have passed"
    for chat in CHATS:
        for add in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=add, tokenize=False) == \
                   reference.apply_chat_template(chat, add_generation_prompt=add, tokenize=False)
    with pytest.raises(Exception, match="roles must be user or assistant, not tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_template_cannot_reach_python_internals(tmp_path, monkeypatch, smol_transformers):
    import jinja2

    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    smol_transformers.save_pretrained(str(folder))
    ours = load_tokenizer(str(folder))
    for template in ("{{ messages.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}",
                     "{{ messages.append(1) }}"):
        ours.chat_template = template
        with pytest.raises(jinja2.exceptions.SecurityError):
            ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_wordpiece_decoding_cleans_up_spaces_as_transformers_does(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "hello", "world", ".", "?", ",", "don", "'",
                                         "t", "s", "it", "##s", "go", "##ne", "!"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                 clean_up_tokenization_spaces=True)
    hf.save_pretrained(str(tmp_path / "wp"))
    reference = AutoTokenizer.from_pretrained(str(tmp_path / "wp"))
    ours = load_tokenizer(str(tmp_path / "wp"))
    assert isinstance(ours, FastTokenizer)
    for text in ("Hello, world. Don't go!", "it's gone ? hello !", "HELLO world , it ' s"):
        ids = reference(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.decode(reference("hello , world .")["input_ids"]) == "hello, world."  # the cleanup happened


def test_a_tokenizer_the_check_refuses_is_read_by_transformers_from_then_on(tmp_path, monkeypatch, caplog,
                                                                              smol_transformers):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    smol_transformers.save_pretrained(str(folder))
    monkeypatch.setattr("worker.model.tokenizer_check.differences", lambda fast, hf: "token 7 decodes differently")
    first = load_tokenizer(str(folder))
    assert not isinstance(first, FastTokenizer)
    assert "token 7 decodes differently" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    again = load_tokenizer(str(folder))
    assert not isinstance(again, FastTokenizer), "the verdict should be kept with the cache entry"
    [entry] = (tmp_path / "cache" / "tokenizers").iterdir()
    assert json.loads((entry / MANIFEST).read_text())["verdict"] == "token 7 decodes differently"
    assert again("Hello")["input_ids"] == smol_transformers("Hello")["input_ids"]


def test_the_check_finds_a_real_difference(smol_tokenizer, smol_transformers):
    from pathlib import Path

    from worker.model.tokenizer_check import differences

    assert differences(smol_tokenizer, smol_transformers) is None
    broken = FastTokenizer.read(Path(smol_tokenizer.name_or_path))
    broken._clean_up = True  # transformers skips the cleanup for a BPE model such as this one
    assert "decodes differently" in differences(broken, smol_transformers)
    broken = FastTokenizer.read(Path(smol_tokenizer.name_or_path))
    broken.chat_template += "{{ eos_token }}"
    assert "the chat template renders" in differences(broken, smol_transformers)
    broken = FastTokenizer.read(Path(smol_tokenizer.name_or_path))
    broken.eos_token_id = 0
    assert "eos_token_id" in differences(broken, smol_transformers)


def test_structured_outputs_build_xgrammars_tokenizer_info_without_transformers_tokenizer(
        smol_tokenizer, smol_transformers, smol_path):
    """xgrammar's own import pulls in transformers; what is saved is loading transformers' tokenizer
    (0.4 s at a process's first structured request)."""
    import xgrammar as xgr

    from worker.engine.structured import grammar
    from worker.engine.structured.grammar import tokenizer_info

    for vocab_size, stops in ((None, None), (49216, [2, 7])):  # the model's logits may be wider than the vocabulary
        ours = tokenizer_info(smol_tokenizer, vocab_size, stops)
        theirs = xgr.TokenizerInfo.from_huggingface(smol_transformers, vocab_size=vocab_size, stop_token_ids=stops)
        assert ours.serialize_json() == theirs.serialize_json()
    from worker.engine.request import StructuredOutput

    fresh = load_tokenizer(smol_path)
    grammar.check(StructuredOutput("json_schema", '{"type": "object"}'), fresh, grammar.CompileRules(seconds=60))
    assert fresh._transformers is None, "the compiler loaded transformers' tokenizer (0.4 s) all the same"


def test_a_llama2_style_tokenizer_adding_bos_reads_as_transformers_does(tmp_path, monkeypatch):
    """SentencePiece-style BPE (the ▁ spaces of Llama 2 and Mistral) with transformers' Llama class,
    which adds BOS through its post-processor, and a template that writes BOS itself."""

    from tokenizers import SentencePieceBPETokenizer, Tokenizer
    from transformers import AutoTokenizer, LlamaTokenizerFast

    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    root = ROOT
    trainer = SentencePieceBPETokenizer(unk_token="<unk>", fuse_unk=True)
    trainer.train_from_iterator([(root / "README.md").read_text()] * 2, vocab_size=600,
                                special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=100)
    hf = LlamaTokenizerFast(tokenizer_object=Tokenizer.from_str(trainer._tokenizer.to_str()), bos_token="<s>",
                            eos_token="</s>", unk_token="<unk>", add_bos_token=True)
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                        "{{ '[INST] ' + m['content'] | trim + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
                        "{{ ' ' + m['content'] | trim + eos_token }}{% endif %}{% endfor %}")
    hf.save_pretrained(str(tmp_path / "llama"))
    reference = AutoTokenizer.from_pretrained(str(tmp_path / "llama"))
    ours = load_tokenizer(str(tmp_path / "llama"))
    assert isinstance(ours, FastTokenizer)
    assert ours("Hello")["input_ids"][0] == reference.bos_token_id == 1
    for text in _texts(2, 100):
        ids = reference(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text
    for chat in CHATS:
        assert ours.apply_chat_template(chat, return_dict=False) == \
               list(reference.apply_chat_template(chat)["input_ids"])


def test_a_tokenizer_berths_reader_fails_on_is_read_by_transformers(tmp_path, monkeypatch, caplog, smol_transformers):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    smol_transformers.save_pretrained(str(tmp_path / "model"))

    def unreadable(*args, **kwargs):
        raise ValueError("no such model type")

    monkeypatch.setattr(FastTokenizer, "read", unreadable)
    tokenizer = load_tokenizer(str(tmp_path / "model"))
    assert not isinstance(tokenizer, FastTokenizer) and len(tokenizer) == 49152
    assert "berth's reader failed on it: ValueError: no such model type" in caplog.text
