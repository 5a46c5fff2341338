"""What users run takes the engine's fast paths (issue 12), on the demo model through the Linux test runtime.

`Session.decode` on the metal backend chooses tokens on the GPU (the decode step's last dispatches) with the next
step committed before the host reads a token, logit bias and penalties included; the CPU sampler
(`LILY_DISABLE_GPU_TOKEN=1`, or a request with logprobs or a windowed repetition penalty) is the reference. Float32 mode: the two paths run the same kernels on the same logits,
so greedy tokens must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from lily import Model
from lily.sampling import SamplingParams
from tests.fixtures import text_config

PROMPT = "KING HENRY:\nWhat say you, my lords?"


@pytest.fixture(scope="module")
def gpu() -> Model:
    return Model.load("lily:demo", backend="metal", precision="float32", progress=False)


@pytest.fixture(scope="module")
def cpu() -> Model:
    """The same engine with the CPU sampler: every step's logits come back and lily.sampling chooses."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LILY_DISABLE_GPU_TOKEN", "1")
        return Model.load("lily:demo", backend="metal", precision="float32", progress=False)


def decode_ids(model: Model, prompt, **sampling) -> tuple[list[int], str, str | None]:
    result = model.generate(prompt, use_cache=False, **sampling)
    return result.token_ids, result.text, result.finish_reason


def test_the_paths_are_the_ones_asked_for(gpu, cpu):
    params = SamplingParams(temperature=0.0)
    assert gpu.backend.gpu_decode_blockers(params) == []
    assert cpu.backend.gpu_decode_blockers(params) == ["the GPU_TOKEN switch is off"]
    assert gpu.backend.gpu_decode_blockers(SamplingParams(logit_bias={3: 1.0}, repetition_penalty=1.1,
                                                          presence_penalty=1.5, frequency_penalty=0.2)) == []
    assert gpu.backend.gpu_decode_blockers(SamplingParams(repetition_penalty=1.1, repetition_context_size=20,
                                                          logprobs=True)) == ["repetition_context_size", "logprobs"]


def test_greedy_decode_is_identical_and_copies_only_token_ids(gpu, cpu):
    session = gpu.prefill(PROMPT, use_cache=False)
    before = gpu.backend.host_read_bytes
    got = [t.id for t in session.decode(max_tokens=64, temperature=0.0, stop_token_ids=())]
    copied = gpu.backend.host_read_bytes - before
    assert copied == 64 * 4, f"{copied} bytes came back for 64 tokens; only their ids (4 bytes each) should"

    want_session = cpu.prefill(PROMPT, use_cache=False)
    before = cpu.backend.host_read_bytes
    want = [t.id for t in want_session.decode(max_tokens=64, temperature=0.0, stop_token_ids=())]
    assert cpu.backend.host_read_bytes - before >= 63 * cpu.config.vocab_size * 4  # the CPU path reads logits
    assert got == want
    # Both sessions hold the same sequence; the GPU one has run its last token (no pending token to feed).
    assert session.tokens == want_session.tokens
    assert session.state.position == len(session.tokens)
    np.testing.assert_allclose(session.logits, want_session.logits, rtol=0, atol=2e-4)


PENALTIES = {
    "presence": {"presence_penalty": 4.0},
    "frequency": {"frequency_penalty": 2.5},
    "repetition": {"repetition_penalty": 1.3},  # over the prompt too
    "logit_bias": "ban the plain decode's favourite token",
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
}


@pytest.fixture(scope="module")
def plain(gpu) -> list[int]:
    return decode_ids(gpu, PROMPT, max_tokens=24, temperature=0.0, stop_token_ids=())[0]


@pytest.mark.parametrize("feature", list(PENALTIES))
def test_penalized_greedy_decode_is_identical_and_copies_only_token_ids(gpu, cpu, plain, feature):
    """Logit bias and penalties on the GPU (penalize_logits before the choice, count_token after it) against the CPU
    sampler over 24 steps: the same tokens, a different decode from the plain one, and only token ids copied."""
    options = PENALTIES[feature]
    if not isinstance(options, dict):
        favourite = max(set(plain), key=plain.count)
        options = {"logit_bias": {favourite: -100.0, plain[0]: -3.0}}
    if feature == "all":
        options = {**options, "logit_bias": {plain[1]: 4.0}}
    session = gpu.prefill(PROMPT, use_cache=False)
    before = gpu.backend.host_read_bytes
    got = [t.id for t in session.decode(max_tokens=24, temperature=0.0, stop_token_ids=(), **options)]
    assert gpu.backend.host_read_bytes - before == 24 * 4
    want = decode_ids(cpu, PROMPT, max_tokens=24, temperature=0.0, stop_token_ids=(), **options)[0]
    assert got == want
    assert got != plain, f"{options} did not change the greedy decode"


def test_a_second_decode_counts_its_own_tokens(gpu, cpu):
    """Presence and frequency count the tokens of the current decode call only; the repetition penalty sees the whole
    session, earlier decodes included (as the CPU sampler's context)."""
    options = dict(max_tokens=12, temperature=0.0, stop_token_ids=(), presence_penalty=1.0, repetition_penalty=1.2)
    runs = []
    for model in (gpu, cpu):
        session = model.prefill(PROMPT, use_cache=False)
        first = [t.id for t in session.decode(**options)]
        second = [t.id for t in session.decode(**options)]
        runs.append((first, second))
    assert runs[0] == runs[1]


def test_sampled_decode_is_reproducible_per_seed(gpu):
    options = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=1.5,
                   stop_token_ids=())
    first = decode_ids(gpu, PROMPT, seed=1234, **options)[0]
    assert decode_ids(gpu, PROMPT, seed=1234, **options)[0] == first
    others = {tuple(decode_ids(gpu, PROMPT, seed=s, **options)[0]) for s in (1, 2, 3)}
    assert len(others | {tuple(first)}) > 1, "different seeds gave the same 12 tokens every time"


BLOCK_PATH = {"sample_partial_f32", "sample_final_f32"}
# A sampled decode's choice kernels, and sample_final's threads: the block path unless top_k is above its candidates
# (64 for the demo's 2048-token vocabulary, one block), at 1024 threads where it may fall back to the general path
# (top-p or min-p without top-k; tuning.h), else 256. The demo checkpoint's generation defaults (top-k 40, top-p
# 0.95) are overridden where they matter.
CHOICE_KERNELS = [
    ({"temperature": 0.7, "top_k": 50, "top_p": 0.9}, BLOCK_PATH, 256),
    ({"temperature": 0.7, "top_k": 64, "min_p": 0.05}, BLOCK_PATH, 256),
    ({"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, BLOCK_PATH, 256),
    ({"temperature": 0.7, "top_k": 20, "presence_penalty": 1.0}, BLOCK_PATH | {"penalize_logits_f32", "count_token"},
     256),
    ({"temperature": 0.7, "top_k": 0, "top_p": 0.9}, BLOCK_PATH, 1024),
    ({"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.05}, BLOCK_PATH, 1024),
    ({"temperature": 0.7, "top_k": 65}, {"sample_f32"}, None),
    ({"temperature": 0.0}, {"argmax_partial_f32", "argmax_final_f32"}, None),
]


def decoded_choice(model: Model, prompt, max_tokens: int, **options) -> tuple[set[str], list]:
    """Decode `max_tokens` tokens (each a vocabulary id); the last step's token-choice kernels and the threads of its
    sample_final dispatches."""
    session = model.prefill(prompt, use_cache=False)
    tokens = [t.id for t in session.decode(max_tokens=max_tokens, stop_token_ids=(), **options)]
    assert len(tokens) == max_tokens and all(0 <= t < model.config.vocab_size for t in tokens)
    by_kernel = model.backend.last_step_counts()["dispatches_by_kernel"]
    choice = {k for k in by_kernel if k.startswith(("sample", "argmax", "penalize", "count_token"))}
    final = [n["threads"] for n in model.backend.last_step_graph()["nodes"] if n["kernel"] == "sample_final_f32"]
    return choice, final


@pytest.mark.parametrize("sampling,kernels,threads", CHOICE_KERNELS, ids=[str(c[0]) for c in CHOICE_KERNELS])
def test_a_sampled_decode_takes_the_block_path_when_the_parameters_allow(gpu, sampling, kernels, threads):
    choice, final = decoded_choice(gpu, PROMPT, 3, seed=7, **sampling)
    assert choice == kernels
    assert final == ([(threads, 1, 1)] if threads else [])


# Past one block (LILY_SAMPLE_BLOCK = 4096 logits, 64 candidates each): a vocabulary of 5000 has 128 candidates, so
# top_k 100 takes the block path (at 1024 threads, as it may fall back) and top_k 129 the one-threadgroup path.
WIDE_CHOICES = [({"top_k": 100}, BLOCK_PATH, 1024), ({"top_k": 129}, {"sample_f32"}, None),
                ({"top_k": 64}, BLOCK_PATH, 256), ({"top_k": 0, "top_p": 0.9}, BLOCK_PATH, 1024)]


@pytest.fixture(scope="module")
def wide() -> Model:
    config = {"model_type": "qwen3_5_moe_text", **text_config("kv64"), "vocab_size": 5000}
    return Model.load(config, backend="metal", precision="float32", load_format="dummy", progress=False)


@pytest.mark.parametrize("sampling,kernels,threads", WIDE_CHOICES, ids=[str(c[0]) for c in WIDE_CHOICES])
def test_the_choice_past_one_block_of_logits(wide, sampling, kernels, threads):
    choice, final = decoded_choice(wide, [5, 17, 4000, 23], 2, seed=3, temperature=0.8, repetition_penalty=1.0,
                                   **sampling)
    assert choice == kernels
    assert final == ([(threads, 1, 1)] if threads else [])


def test_stops_match_the_cpu_path_and_a_second_turn_equals_a_fresh_session(gpu, cpu):
    reference, text, _ = decode_ids(cpu, PROMPT, max_tokens=24, temperature=0.0, stop_token_ids=())
    # An end token in the middle, and a stop string that ends inside a later token's text.
    stop_id = reference[5]
    cut = reference.index(stop_id)
    for options in ({"stop_token_ids": [stop_id]}, {"stop": [text[len(text) // 2: len(text) // 2 + 3]],
                                                    "stop_token_ids": ()}):
        want = decode_ids(cpu, PROMPT, max_tokens=24, temperature=0.0, **options)
        got = decode_ids(gpu, PROMPT, max_tokens=24, temperature=0.0, **options)
        assert got == want and want[2] == "stop"
    assert decode_ids(gpu, PROMPT, max_tokens=24, temperature=0.0, stop_token_ids=[stop_id])[0] == reference[:cut + 1]

    # A second turn after the stop continues exactly as a fresh session over the whole sequence.
    more = gpu.encode("\nQUEEN:\n")
    session = gpu.prefill(PROMPT, use_cache=False)
    list(session.decode(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))
    assert len(session) == len(gpu.encode(PROMPT)) + cut + 1
    gpu.prefill(more, session=session)
    second = [t.id for t in session.decode(max_tokens=8, temperature=0.0, stop_token_ids=())]
    fresh = gpu.prefill(gpu.encode(PROMPT) + reference[:cut + 1] + more, use_cache=False)
    assert [t.id for t in fresh.decode(max_tokens=8, temperature=0.0, stop_token_ids=())] == second


def test_closing_the_iterator_leaves_the_yielded_tokens_run(gpu):
    session = gpu.prefill(PROMPT, use_cache=False)
    tokens = session.decode(max_tokens=50, temperature=0.0, stop_token_ids=())
    taken = [next(tokens).id for _ in range(3)]
    tokens.close()
    assert session.tokens[-3:] == taken and session.state.position == len(session)
    assert not gpu.backend._engine.steps_in_flight


def test_a_cpu_only_feature_falls_back_for_that_request_only(gpu, cpu):
    options = dict(max_tokens=6, temperature=0.0, stop_token_ids=(), logit_bias={11: 5.0}, logprobs=True)
    got = gpu.generate(PROMPT, use_cache=False, **options)
    want = cpu.generate(PROMPT, use_cache=False, **options)
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-6)


def test_prefill_copies_one_row_of_logits(gpu):
    ids = np.random.default_rng(5).integers(0, gpu.config.vocab_size, size=512).tolist()
    before = gpu.backend.host_read_bytes
    session = gpu.prefill(ids, use_cache=False)
    assert gpu.backend.host_read_bytes - before == gpu.config.vocab_size * 4
    assert session._last_logits.shape == (gpu.config.vocab_size,)
    # lm_head ran for one row only (the prefill graph's last GEMM is a one-row qmv).
    lm_head = [n for n in gpu.backend.last_step_graph()["nodes"] if n["label"] == "lm_head"]
    assert len(lm_head) == 1 and lm_head[0]["kernel"].startswith("qmv")
