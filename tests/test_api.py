"""The public API (lily.Model / Session / Token / Result) on the tiny random checkpoint.

Oracles: HF transformers (the fp32 model the checkpoint was written from) for logits, greedy
continuations and logprobs; lily.chat.parse_assistant for the chat channel split. The tiny
checkpoint has no tokenizer, so ``chat_model_dir`` adds a small hand-made byte-level BPE one
(byte alphabet, five merges, the Qwen special tokens) to a copy of it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

import lily
from lily.chat import parse_assistant

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("Ġ", "a")]
# Letters that take part in no merge: text made of them re-encodes token for token.
FREE_LETTERS = "bcdfgjkm"


def write_test_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer.json + tokenizer_config.json (ids 0..269, below the model's 1024)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def chat_model_dir(tiny_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kv64 fp32 checkpoint plus the test tokenizer."""
    out = tmp_path_factory.mktemp("chat-model") / "kv64"
    shutil.copytree(tiny_hf_dir, out)
    write_test_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def model(chat_model_dir: Path) -> lily.Model:
    return lily.Model.load(chat_model_dir, backend="reference")


def letters_only_bias(model: lily.Model, allow_eos: bool = True) -> dict[int, float]:
    """logit_bias that leaves only FREE_LETTERS (and the end tokens) possible."""
    allowed = {model.tokenizer.token_to_id(c) for c in FREE_LETTERS}
    if allow_eos:
        allowed |= set(model.eos_token_ids)
    return {i: -100.0 for i in range(model.config.vocab_size) if i not in allowed}


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def random_ids(seed: int, n: int, high: int = 1024) -> list[int]:
    return np.random.default_rng(seed).integers(0, high, size=n).tolist()


class CountingBackend:
    """Wraps a backend and counts the tokens that go through forward."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def new_state(self):
        return self.inner.new_state()

    def forward(self, ids, state, *, last_only=False):
        self.calls.append(len(ids))
        return self.inner.forward(ids, state, last_only=last_only)


class ScriptedState:
    """The state of ScriptedBackend: only a position."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def copy(self) -> ScriptedState:
        return ScriptedState(self.position)


class ScriptedBackend:
    """A stand-in backend whose output is scripted: once the sequence passes ``start`` tokens, the
    logits make the next scripted token the only choice (template, sampling, detokenizer and parser
    above it are the real ones)."""

    def __init__(self, vocab_size: int, script: list[int], start: int) -> None:
        self.vocab_size, self.script, self.start = vocab_size, list(script), start

    def new_state(self) -> ScriptedState:
        return ScriptedState()

    def forward(self, ids, state: ScriptedState, *, last_only: bool = False) -> np.ndarray:
        state.position += len(ids)
        logits = np.zeros((len(ids), self.vocab_size), dtype=np.float32)
        step = state.position - self.start
        if 0 <= step < len(self.script):
            logits[-1] = -1e9
            logits[-1, self.script[step]] = 0.0
        return logits


def with_backend(model: lily.Model, backend) -> lily.Model:
    """A model sharing checkpoint and tokenizer, with another backend and an empty cache."""
    return lily.Model(backend, model.config, model.tokenizer, backend_name=model.backend_name,
                      fingerprint=model.fingerprint, path=model.path)


# ---- public surface ---------------------------------------------------------------------------


def test_public_names_are_few_and_documented():
    assert set(lily.__all__) == {"Model", "Session", "Token", "Result", "Stats", "Snapshot", "Cancelled", "__version__"}
    for name in set(lily.__all__) - {"__version__"}:
        assert getattr(lily, name).__doc__
    from importlib.metadata import version

    assert lily.__version__ == version("lily")
    for method in ("load", "logits", "prefill", "generate", "chat"):
        assert getattr(lily.Model, method).__doc__
    for method in ("decode", "snapshot", "restore", "fork", "save", "load"):
        assert getattr(lily.Session, method).__doc__


def test_load_sets_config_tokenizer_and_backend(model, chat_model_dir, monkeypatch):
    assert model.backend_name == "reference"
    # "auto"; the engine backends run quantized weights: an HF checkpoint is quantized on load.
    assert lily.Model.load(chat_model_dir, quantize=4).backend_name == ("metal" if sys.platform == "darwin" else "cpu")
    assert model.config.vocab_size == 1024
    assert model.tokenizer.token_to_id("<|im_end|>") in model.eos_token_ids
    assert model.tokenizer.token_to_id("<|endoftext|>") in model.eos_token_ids
    # A machine without the cuda backend, whatever driver this process opened before (the fake libcuda in CI).
    monkeypatch.setattr("lily.backends.cuda.cuda_unavailable", lambda: "no NVIDIA driver: (test)")
    with pytest.raises(RuntimeError, match=r"backend='cuda' is unavailable: no NVIDIA driver"):
        lily.Model.load(chat_model_dir, backend="cuda")


def test_max_context_is_checked_before_loading(chat_model_dir):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_context must be a positive integer"):
            lily.Model.load(chat_model_dir, backend="reference", max_context=bad)
    limit = lily.Model.load(chat_model_dir, backend="reference").config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_context={limit + 1} exceeds the model's context of {limit}"):
        lily.Model.load(chat_model_dir, backend="reference", max_context=limit + 1)


def test_prefill_step_size_is_the_engine_chunk_unless_given(chat_model_dir):
    """Prompts reach an engine backend in pieces of its own prefill chunk (the PrefillChunking capability), other
    backends in 512s; a given step wins; a bad one is refused before anything loads."""
    from lily import _ext
    from lily.backends import PrefillChunking

    for bad in (0, -1, 2.5, True, "512"):
        with pytest.raises(ValueError, match="prefill_step_size must be a positive integer"):
            lily.Model.load(chat_model_dir, backend="reference", prefill_step_size=bad)
    reference = lily.Model.load(chat_model_dir, backend="reference")
    assert not isinstance(reference.backend, PrefillChunking) and reference.prefill_step_size == 512
    assert lily.Model.load(chat_model_dir, backend="reference", prefill_step_size=64).prefill_step_size == 64
    engine = lily.Model.load(chat_model_dir, backend="metal", quantize=4, progress=False)  # Linux: the test runtime
    assert isinstance(engine.backend, PrefillChunking)
    assert engine.prefill_step_size == engine.backend.prefill_chunk == _ext.prefill_chunk > 512


def test_bench_profile_table_sums_each_kernel(model):
    from lily import bench

    table = bench.format_profile([("qmm", "l0 q", 1.0), ("moe", "l0 experts", 3.0), ("qmm", "l1 q", 2.5)], 8)
    assert table.splitlines()[0] == "device time of a 8-token prefill, node by node: 6.50 ms over 3 launches"
    assert table.splitlines()[3:] == ["| `qmm` | 2 | 3.500 | 53.8% | 1750.0 |", "| `moe` | 1 | 3.000 | 46.2% | 3000.0 |"]
    with pytest.raises(ValueError, match="--profile needs the cuda or cpu backend"):
        bench.require_profiling(model, 8)  # the reference backend


def test_bench_sizes_the_context_to_its_deepest_test():
    from lily import bench

    assert bench.context_needed([512, 4096], [128], [0, 4096]) is None  # within the engine's default 32768
    assert bench.context_needed([1, 8, 512, 4096], [128], [32768]) == 32768 + 4096 + 1
    assert bench.context_needed([0], [128], [32768]) == 32768 + 128 + 1


def test_quantized_checkpoint_generates(tiny_mlx4_dir):
    m = lily.Model.load(tiny_mlx4_dir, backend="reference")
    prompt = random_ids(7, 5)
    result = m.generate(prompt, max_tokens=3, temperature=0, stop_token_ids=[])
    assert len(result.token_ids) == 3
    assert int(m.logits(prompt + result.token_ids[:2])[-1].argmax()) == result.token_ids[2]


def test_checkpoint_without_tokenizer_takes_token_ids(tiny_hf_dir):
    m = lily.Model.load(tiny_hf_dir, backend="reference")
    assert m.tokenizer is None
    result = m.generate(random_ids(8, 4), max_tokens=2, temperature=0, stop_token_ids=[])
    assert len(result.token_ids) == 2 and result.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        m.generate("hello")


# ---- logits and greedy decoding against HF transformers -------------------------------------------


def test_logits_match_transformers(model, tiny_hf_model):
    ids = random_ids(1, 24)
    got = model.logits(ids)
    ref = hf_logits(tiny_hf_model, ids)
    assert got.shape == (24, 1024) and got.dtype == np.float32
    # relative error = max|a-b| / max|b|
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


def test_greedy_generation_matches_transformers_argmax_loop(model, tiny_hf_model):
    prompt = random_ids(2, 12)
    result = model.generate(prompt, max_tokens=5, temperature=0, stop_token_ids=[], use_cache=False)
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(np.argmax(hf_logits(tiny_hf_model, ids)[-1])))
    assert result.token_ids == ids[len(prompt):]
    assert result.finish_reason == "length"
    assert result.stats.prompt_tokens == 12 and result.stats.generation_tokens == 5


def test_logprobs_are_transformers_log_softmax(model, tiny_hf_model):
    prompt = random_ids(3, 10)
    result = model.generate(prompt, max_tokens=3, temperature=0, logprobs=True, top_logprobs=4,
                            stop_token_ids=[], use_cache=False)
    ids = list(prompt)
    for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
        ref = torch.log_softmax(torch.tensor(hf_logits(tiny_hf_model, ids)[-1], dtype=torch.float64), -1).numpy()
        assert logprob == pytest.approx(ref[token], abs=1e-4)
        assert [t for t, _ in top][:1] == [token]
        assert [lp for _, lp in top] == pytest.approx(np.sort(ref)[::-1][:4].tolist(), abs=1e-4)
        ids.append(token)


def test_text_prompt_equals_its_token_ids(model):
    text = "the thin cat"
    a = model.generate(text, max_tokens=4, temperature=0, use_cache=False)
    b = model.generate(model.tokenizer.encode(text), max_tokens=4, temperature=0, use_cache=False)
    assert a.token_ids == b.token_ids and a.text == b.text


# ---- finishing: stop tokens, stop strings, max_tokens ------------------------------------------------


@pytest.mark.parametrize("end_token", ["<|im_end|>", "<|endoftext|>"])
def test_both_end_tokens_stop_without_text(model, end_token):
    eos = model.tokenizer.token_to_id(end_token)
    result = model.generate("hi", max_tokens=5, temperature=0, logit_bias={eos: 100.0}, use_cache=False)
    assert result.token_ids == [eos] and result.finish_reason == "stop" and result.text == ""


def test_stop_string_across_tokens_is_cut_and_not_leaked(model):
    bias = letters_only_bias(model, allow_eos=False)
    free = model.generate("abc", max_tokens=12, temperature=0, logit_bias=bias, use_cache=False)
    assert len(free.text) == 12  # one letter per token
    stop = free.text[5:7]  # spans two tokens
    tokens = list(model.prefill("abc", use_cache=False).decode(max_tokens=12, temperature=0, logit_bias=bias,
                                                                stop=[stop, "never"]))
    shown = "".join(t.text for t in tokens)
    assert shown == free.text[: free.text.find(stop)]
    assert tokens[-1].finish_reason == "stop" and all(t.finish_reason is None for t in tokens[:-1])
    assert len(tokens) == free.text.find(stop) + len(stop)


def test_max_tokens_gives_length(model):
    tokens = list(model.prefill("abc", use_cache=False).decode(max_tokens=3, temperature=0,
                                                                stop_token_ids=[]))
    assert len(tokens) == 3 and tokens[-1].finish_reason == "length"
    assert tokens[-1].stats.generation_tokens == 3 and tokens[-1].stats.generation_tps > 0


def test_max_tokens_beyond_the_context_is_refused_and_a_full_context_ends_with_length(model):
    context = model.config.max_position_embeddings
    message = f"max_tokens must be at most the model's context of {context} tokens"
    with pytest.raises(ValueError, match=f"Model.generate\\(\\): {message}"):
        model.generate("abc", max_tokens=context + 1)
    with pytest.raises(ValueError, match=f"Model.chat\\(\\): {message}.*got 10000000000"):
        model.chat([{"role": "user", "content": "hi"}], max_tokens=10**10)
    with pytest.raises(ValueError, match=f"Session.decode\\(\\): {message}"):
        model.prefill("abc", use_cache=False).decode(max_tokens=context + 1)
    # A max_tokens that fits the context, but not after this prompt: the answer ends where the context does.
    scripted = with_backend(model, ScriptedBackend(model.config.vocab_size, [], 0))
    tokens = list(scripted.prefill([5] * (context - 3), use_cache=False).decode(max_tokens=10, stop_token_ids=[]))
    assert len(tokens) == 3 and tokens[-1].finish_reason == "length"
    # A chat's default max_tokens (DEFAULT_CHAT_MAX_TOKENS) is no error on a model with a smaller context.
    small = lily.Model(scripted.backend, dataclasses.replace(model.config, max_position_embeddings=64), model.tokenizer,
                       backend_name="scripted", fingerprint="small")
    result = small.chat([{"role": "user", "content": "hi"}], temperature=0, stop_token_ids=[])
    assert result.finish_reason == "length" and result.stats.prompt_tokens + result.stats.generation_tokens == 64


def test_same_seed_same_tokens(model):
    def run(seed):
        return model.generate("abc", max_tokens=6, temperature=1.0, seed=seed, stop_token_ids=[],
                              use_cache=False).token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_bad_inputs_raise_clear_errors(model):
    with pytest.raises(ValueError, match="top_p"):
        model.generate("abc", top_p=0)
    with pytest.raises(ValueError, match="logit_bias"):
        model.generate("abc", logit_bias={5000: 1.0})
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1024\)"):
        model.generate([1, 2, 4096])
    with pytest.raises(ValueError, match="prompt"):
        model.generate([])
    with pytest.raises(ValueError, match="too long"):
        model.prefill([5] * (model.config.max_position_embeddings + 1), use_cache=False)


# ---- closing and cancelling ------------------------------------------------------------------------


def test_closing_the_iterator_stops_the_work(model):
    counting = CountingBackend(model.backend)
    m = with_backend(model, counting)
    session = m.prefill(random_ids(4, 6), use_cache=False)
    tokens = session.decode(max_tokens=50, temperature=0, stop_token_ids=[])
    first = [next(tokens), next(tokens)]
    tokens.close()
    calls = len(counting.calls)
    assert calls == 2  # the prefill and the step that produced the second token
    assert len(session) == 8 and session.tokens[-2:] == [t.id for t in first]


def test_cancel_between_prefill_chunks_and_between_tokens(model):
    counting = CountingBackend(model.backend)
    m = with_backend(model, counting)
    m.prefill_step_size = 4
    checks = iter([False, False, True])
    with pytest.raises(lily.Cancelled):
        m.prefill(random_ids(5, 20), cancel=lambda: next(checks), use_cache=False)
    assert counting.calls == [4, 4]

    event = threading.Event()
    session = m.prefill(random_ids(6, 3), use_cache=False)
    counting.calls.clear()
    tokens = session.decode(max_tokens=50, temperature=0, stop_token_ids=[], cancel=event)
    next(tokens), next(tokens)
    event.set()
    with pytest.raises(lily.Cancelled):
        next(tokens)
    assert counting.calls == [1]  # the second token's step; nothing after the cancel


# ---- chat -------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def scripted_chat(model: lily.Model, reply: str, **kw):
    tok = model.tokenizer
    script = tok.encode(reply) + [tok.token_to_id("<|im_end|>")]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    start = len(model.encode(messages, tools=TOOLS, enable_thinking=kw.get("enable_thinking", True)))
    m = with_backend(model, ScriptedBackend(model.config.vocab_size, script, start))
    return m.chat(messages, tools=TOOLS, temperature=0, max_tokens=200, **kw)


REPLY = ("Let me check.\n</think>\n\nI will look it up.\n\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_chat_splits_reasoning_content_and_tool_calls(model):
    result = scripted_chat(model, REPLY)
    expected = parse_assistant(REPLY, tools=TOOLS, thinking=True)
    assert result.text == REPLY
    assert result.reasoning == (expected.reasoning or "") and "Let me check." in result.reasoning
    assert result.content == expected.content
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert result.finish_reason == "tool_calls"


def test_chat_stream_carries_the_same_channels(model):
    tokens = list(scripted_chat(model, REPLY, stream=True))
    whole = scripted_chat(model, REPLY)
    assert "".join(t.reasoning for t in tokens) == whole.reasoning
    assert "".join(t.content for t in tokens) == whole.content
    assert [c.name for t in tokens for c in t.tool_calls] == ["get_weather"]
    assert tokens[-1].finish_reason == "tool_calls" and tokens[-1].stats.prompt_tokens > 0


def test_chat_without_thinking_is_all_content(model):
    result = scripted_chat(model, "Plain answer.", enable_thinking=False)
    assert result.content == "Plain answer." and result.reasoning == "" and result.finish_reason == "stop"


# ---- argument checks and defaults ------------------------------------------------------------------


@pytest.mark.parametrize("call, error, needle", [
    (lambda m: m.generate("abc", temp=0.5), TypeError, r"Model\.generate\(\).*'temp'.*'temperature'"),
    (lambda m: m.generate("abc", repeat_penalty=1.1), TypeError, r"Model\.generate\(\).*'repetition_penalty'"),
    (lambda m: m.generate("abc", temperature=-1), ValueError, r"Model\.generate\(\): temperature"),
    (lambda m: m.generate("abc", stop=5), ValueError, r"Model\.generate\(\): stop must be a string or a list"),
    (lambda m: m.generate("abc", logit_bias={"a": 1}), ValueError, r"Model\.generate\(\): logit_bias must be a mapping whose keys are token ids.*'a'"),
    (lambda m: m.generate("abc", max_tokens=0), ValueError, r"Model\.generate\(\): max_tokens"),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], top_k=-1), ValueError, r"Model\.chat\(\): top_k"),
    (lambda m: m.chat([{"role": "user", "content": "hi"}], temprature=0), TypeError, r"Model\.chat\(\).*'temperature'"),
    (lambda m: m.generate(b"ROMEO"), TypeError, r"got bytes"),
    (lambda m: m.generate("cut \ud83d"), ValueError, r"prompt contains a lone UTF-16 surrogate"),
])
def test_arguments_are_checked_before_any_work(model, call, error, needle):
    counting = CountingBackend(model.backend)
    m = with_backend(model, counting)
    with pytest.raises(error, match=needle):
        call(m)
    assert counting.calls == []  # refused before the prefill


def test_logits_take_text_or_ids_and_respect_the_context(model):
    ids = model.tokenizer.encode("the cat")
    np.testing.assert_array_equal(model.logits("the cat"), model.logits(ids))
    counting = CountingBackend(model.backend)
    with pytest.raises(ValueError, match=r"Model\.logits\(\): .*exceed the model context"):
        with_backend(model, counting).logits([1] * (model.config.max_position_embeddings + 1))
    assert counting.calls == []


def test_load_names_a_bad_argument():
    with pytest.raises(TypeError, match=r"Model\.load\(\): path_or_repo .* got NoneType"):
        lily.Model.load(None)


def test_defaults_come_from_generation_config_in_every_entry_point(model, chat_model_dir, tmp_path):
    """One set of defaults: generation_config.json's sampling values apply to generate/decode/chat
    unless overridden, and max_tokens defaults to 256 (chat: 4096)."""
    from lily.sampling import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_TOKENS

    assert (DEFAULT_MAX_TOKENS, DEFAULT_CHAT_MAX_TOKENS) == (256, 4096)
    directory = tmp_path / "with-config"
    shutil.copytree(chat_model_dir, directory)
    config = {"temperature": 0.7, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.3}
    (directory / "generation_config.json").write_text(json.dumps(config))
    configured = lily.Model.load(directory, backend="reference")
    assert configured.sampling_defaults == config
    seeded = dict(seed=5, stop_token_ids=[], use_cache=False)
    explicit = model.generate("the", max_tokens=12, **config, **seeded)
    implicit = configured.generate("the", max_tokens=12, **seeded)
    assert implicit.token_ids == explicit.token_ids
    streamed = list(configured.generate("the", max_tokens=12, stream=True, **seeded))
    assert [t.id for t in streamed] == explicit.token_ids
    # An explicit value still wins over the checkpoint's.
    greedy = configured.generate("the", max_tokens=12, temperature=0, **seeded)
    assert greedy.token_ids == model.generate("the", max_tokens=12, temperature=0, top_k=3, top_p=0.9,
                                              repetition_penalty=1.3, **seeded).token_ids
    # max_tokens: 256 by default (not "until the context ends"), None for no limit.
    counted = list(model.prefill("the", use_cache=False).decode(temperature=0, stop_token_ids=[]))
    assert len(counted) == DEFAULT_MAX_TOKENS and counted[-1].finish_reason == "length"
