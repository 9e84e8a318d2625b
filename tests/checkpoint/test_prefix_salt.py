"""The prefix cache's trust boundary: tenants' identical prompts never hit each other's cached blocks
(no shared blocks, no timing to learn from), unless they share a cache salt; and each finished
request says how many of its prompt tokens came from the cache."""

from __future__ import annotations

from tests.support.models import cut_prompts
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0)


def _run_one(engine: Engine, request: Request):
    engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            return out


def test_tenants_do_not_hit_each_others_prefix_cache(tiny_loaded, text_ids):
    prompt = cut_prompts(text_ids, [100])[0]  # 6 full blocks; the block of the last token is always computed
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", block_size=16)
    first = _run_one(engine, Request("a1", prompt, GREEDY, tenant="alice"))
    assert first.num_cached_prompt_tokens == 0 and engine.stats.prompt_tokens_cached == 0
    again = _run_one(engine, Request("a2", prompt, GREEDY, tenant="alice"))
    assert again.num_cached_prompt_tokens == 96 and engine.stats.prompt_tokens_cached == 96  # the control
    other = _run_one(engine, Request("b1", prompt, GREEDY, tenant="bob"))
    assert other.num_cached_prompt_tokens == 0 and engine.stats.prompt_tokens_cached == 96
    assert engine.stats.prompt_tokens_computed == 100 + 4 + 100
    assert other.completions[0].token_ids == first.completions[0].token_ids == again.completions[0].token_ids


def test_a_shared_salt_lets_tenants_share(tiny_loaded, text_ids):
    prompt = cut_prompts(text_ids, [100])[0]
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", block_size=16)
    _run_one(engine, Request("a", prompt, GREEDY, tenant="alice", cache_salt="group:lab"))
    shared = _run_one(engine, Request("b", prompt, GREEDY, tenant="bob", cache_salt="group:lab"))
    assert shared.num_cached_prompt_tokens == 96
    outsider = _run_one(engine, Request("c", prompt, GREEDY, tenant="carol", cache_salt="group:other"))
    assert outsider.num_cached_prompt_tokens == 0
    alice_alone = _run_one(engine, Request("d", prompt, GREEDY, tenant="alice"))  # her own key, not the group's
    assert alice_alone.num_cached_prompt_tokens == 0
    assert engine.stats.prompt_tokens_cached == 96


def test_the_default_tenant_keeps_the_unsalted_names(tiny_loaded, text_ids):
    """Checkpoints and runs written before salts existed (every one of the default tenant) keep their names."""
    from worker.engine.block_manager import chain_hash

    prompt = cut_prompts(text_ids, [40])[0]
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", block_size=16)
    hashes = engine.prefix_block_hashes(Request("x", prompt))
    assert hashes[0] == chain_hash(b"", prompt[:16]) and len(hashes) == 2
    assert engine.prefix_block_hashes(Request("y", prompt, tenant="alice"))[0] != hashes[0]
