"""Sessions and prompt caches: snapshot/restore/fork, save/load, and multi-turn prefix reuse.

The oracle for every reuse path is a fresh computation of the same tokens with no cache: the
restored or cached session must give the same logits and the same greedy tokens.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import lily
from lily.snapshot import PromptCache, Snapshot
from test_api import (  # noqa: F401 (chat_model_dir and model are fixtures)
    CountingBackend,
    chat_model_dir,
    letters_only_bias,
    model,
    random_ids,
    with_backend,
    write_test_tokenizer,
)


def fresh_logits(model: lily.Model, ids: list[int]) -> np.ndarray:
    return model.logits(ids)[-1]


# ---- snapshot / restore / fork ----------------------------------------------------------------------


def test_restored_session_continues_exactly(model):
    prompt, more = random_ids(20, 9), random_ids(21, 5)
    session = model.prefill(prompt, use_cache=False)
    snap = session.snapshot()
    assert isinstance(snap, lily.Snapshot) and isinstance(session.stats, lily.Stats)
    first = [t.id for t in session.decode(max_tokens=4, temperature=0, stop_token_ids=[])]
    model.prefill(more, session=session)
    logits_a = session.logits
    session.restore(snap)
    assert session.tokens == prompt
    second = [t.id for t in session.decode(max_tokens=4, temperature=0, stop_token_ids=[])]
    model.prefill(more, session=session)
    assert first == second
    np.testing.assert_array_equal(session.logits, logits_a)
    np.testing.assert_allclose(logits_a, fresh_logits(model, prompt + first + more), rtol=0, atol=1e-5)


def test_fork_gives_independent_sessions(model):
    prompt = random_ids(22, 7)
    a = model.prefill(prompt, use_cache=False)
    b = a.fork()
    model.prefill([3, 4, 5], session=a)
    model.prefill([9], session=b)
    assert a.tokens == prompt + [3, 4, 5] and b.tokens == prompt + [9]
    np.testing.assert_allclose(a.logits, fresh_logits(model, prompt + [3, 4, 5]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(b.logits, fresh_logits(model, prompt + [9]), rtol=0, atol=1e-5)


def test_snapshot_from_another_model_is_refused(model):
    other = with_backend(model, model.backend)
    other.fingerprint = "0" * 16
    with pytest.raises(ValueError, match="different model"):
        other.new_session().restore(model.prefill([1, 2], use_cache=False).snapshot())


# ---- save / load ---------------------------------------------------------------------------------------


def test_saved_session_loads_and_continues_identically(model, tmp_path):
    prompt = random_ids(23, 8)
    session = model.prefill(prompt, use_cache=False)
    list(session.decode(max_tokens=2, temperature=0, stop_token_ids=[]))
    path = tmp_path / "s.safetensors"
    session.save(path)
    loaded = lily.Session.load(path, model)
    assert loaded.tokens == session.tokens
    np.testing.assert_array_equal(loaded.logits, session.logits)
    a = [t.id for t in session.decode(max_tokens=3, temperature=0, stop_token_ids=[])]
    b = [t.id for t in loaded.decode(max_tokens=3, temperature=0, stop_token_ids=[])]
    assert a == b


def test_session_file_errors_are_clear(model, tiny_checkpoints, tmp_path):
    path = tmp_path / "s.safetensors"
    model.prefill([5, 6, 7], use_cache=False).save(path)

    other_dir = tmp_path / "seed1"
    shutil.copytree(tiny_checkpoints.hf("kv64", seed=1), other_dir)
    write_test_tokenizer(other_dir)
    other = lily.Model.load(other_dir, backend="reference")
    with pytest.raises(ValueError, match="different model"):
        lily.Session.load(path, other)

    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        lily.Session.load(tmp_path / "missing.safetensors", model)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="broken.safetensors"):
        lily.Session.load(broken, model)


# ---- the prompt cache -------------------------------------------------------------------------------------


def snap(tokens, nbytes=8) -> Snapshot:
    return Snapshot(state=[np.zeros(nbytes // 4, dtype=np.float32)], token_ids=tuple(tokens),
                    last_logits=None, fingerprint="x")


def test_prompt_cache_longest_prefix_and_lru_bounds():
    cache = PromptCache(max_entries=3, max_bytes=1000)
    for key in ([1], [1, 2], [1, 2, 3], [7, 8]):
        cache.insert(snap(key))
    assert len(cache) == 3 and (1,) not in cache.keys()  # least recently used went first
    assert cache.longest_prefix([1, 2, 3, 4]).token_ids == (1, 2, 3)
    assert cache.longest_prefix([1, 2, 9]).token_ids == (1, 2)
    assert cache.longest_prefix([2, 1]) is None
    cache.insert(snap([5]))  # (7, 8) is now the least recently used
    assert cache.keys() == [(1, 2, 3), (1, 2), (5,)]

    small = PromptCache(max_entries=10, max_bytes=100)
    for i in range(5):
        small.insert(snap([i], nbytes=40))
    assert small.nbytes <= 100 and small.keys() == [(3,), (4,)]
    small.insert(snap([9], nbytes=400))  # larger than the whole budget: not stored
    assert (9,) not in small.keys()


def test_repeated_prompt_is_served_from_cache(model):
    m = with_backend(model, CountingBackend(model.backend))
    prompt = random_ids(24, 10)
    first = m.generate(prompt, max_tokens=3, temperature=0, stop_token_ids=[])
    m.backend.calls.clear()
    again = m.generate(prompt, max_tokens=3, temperature=0, stop_token_ids=[])
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens == 10 and first.stats.cached_tokens == 0
    assert m.backend.calls == [1, 1]  # no prefill at all, two decode steps


def chat_opts(m: lily.Model, allow_eos: bool = True, **template) -> dict:
    return dict(temperature=0, max_tokens=6, logit_bias=letters_only_bias(m, allow_eos), **template)


def first_turn(m: lily.Model, allow_eos: bool = True, **template):
    """Run turn 1; return its result and the turn-2 conversation built from it."""
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = m.chat(turn1, **chat_opts(m, allow_eos, **template))
    turn2 = turn1 + [{"role": "assistant", "content": first.content, "reasoning_content": first.reasoning},
                     {"role": "user", "content": "more"}]
    return first, turn2


@pytest.mark.parametrize("turn1_end", ["stop", "length"])
def test_two_turn_chat_reprefills_only_the_new_turn(model, turn1_end):
    """MUST SHOW: turn 2 restores the end-of-generation checkpoint of turn 1, runs only the new
    tokens, and answers exactly as a fresh prefill of the whole conversation."""
    template = dict(enable_thinking=False, preserve_thinking=True)
    m = with_backend(model, CountingBackend(model.backend))
    first, turn2 = first_turn(m, allow_eos=turn1_end == "stop", **template)
    assert first.finish_reason == turn1_end
    m.backend.calls.clear()
    second = m.chat(turn2, **chat_opts(m, **template))

    prompt1 = m.encode(turn2[:2], **template)
    prompt2 = m.encode(turn2, **template)
    processed1 = prompt1 + first.token_ids[:-1]  # the last sampled token was never run
    assert prompt2[: len(processed1)] == processed1
    assert second.stats.cached_tokens == len(processed1)
    assert second.stats.prompt_tokens == len(prompt2)
    new_turn = prompt2[len(processed1):]
    last_of_turn1 = "" if turn1_end == "stop" else first.text[-1]
    assert m.tokenizer.decode(new_turn).startswith(last_of_turn1 + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>")
    # tokens run through the model in turn 2: the new turn, then one per generated token but the last
    assert sum(m.backend.calls) == len(new_turn) + len(second.token_ids) - 1

    fresh = with_backend(model, model.backend).chat(turn2, **chat_opts(model, **template))
    assert fresh.stats.cached_tokens == 0
    assert fresh.token_ids == second.token_ids and fresh.text == second.text


def test_two_turn_chat_without_preserved_thinking_reuses_the_user_checkpoint(model):
    """When the template drops the earlier turn's think block, the end of the first user message
    (just before the assistant header) is the longest reusable point."""
    m = with_backend(model, model.backend)
    _, turn2 = first_turn(m, enable_thinking=False)
    second = m.chat(turn2, **chat_opts(m, enable_thinking=False))
    prompt1 = m.encode(turn2[:2], enable_thinking=False)
    start = m.tokenizer.token_to_id("<|im_start|>")
    assert second.stats.cached_tokens == max(i for i, t in enumerate(prompt1) if t == start)
    fresh = with_backend(model, model.backend).chat(turn2, **chat_opts(model, enable_thinking=False))
    assert fresh.stats.cached_tokens == 0 and fresh.token_ids == second.token_ids


def test_system_and_tools_turn_is_reused_by_a_new_conversation(model):
    from test_api import TOOLS, ScriptedBackend

    m = with_backend(model, ScriptedBackend(model.config.vocab_size, [], 0))
    m.chat([{"role": "user", "content": "first question"}], tools=TOOLS, max_tokens=1, temperature=0)
    other = [{"role": "user", "content": "another one"}]
    result = m.chat(other, tools=TOOLS, max_tokens=1, temperature=0)
    ids = m.encode(other, tools=TOOLS)
    start = m.tokenizer.token_to_id("<|im_start|>")
    system_end = [i for i, t in enumerate(ids) if t == start][1]
    assert m.tokenizer.decode(ids[:system_end]).startswith("<|im_start|>system\n# Tools")
    assert result.stats.cached_tokens == system_end
