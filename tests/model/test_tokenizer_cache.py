"""A GGUF file's tokenizer is converted once and then read from berth's cache, unchanged."""

from __future__ import annotations

from worker.model.tokenizer import load_tokenizer


def test_a_gguf_tokenizer_is_converted_once_and_cached_unchanged(tmp_path, monkeypatch, smol_path):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer(smol_path)
    [entry] = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer(smol_path)
    assert cached.name_or_path == str(entry), "the second load should come from the cache"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Ünïcode, 日本語 and code: x += 1"}]
    texts = [t.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) for t in (converted, cached)]
    assert texts[0] == texts[1]
    assert converted(texts[0])["input_ids"] == cached(texts[1])["input_ids"]
    assert (converted.eos_token_id, converted.all_special_ids, len(converted)) == \
           (cached.eos_token_id, cached.all_special_ids, len(cached))


def test_a_damaged_cache_entry_is_converted_again(tmp_path, monkeypatch, smol_path):
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path))
    load_tokenizer(smol_path)
    [entry] = (tmp_path / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    assert len(load_tokenizer(smol_path)) == 49152
    assert load_tokenizer(smol_path).name_or_path == str(entry), "the entry should have been written again"
