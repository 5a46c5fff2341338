"""One SamplingParams from every entry point: a field out of range gets the same message naming the field from
Model.generate, Model.chat, Session.decode, the server (both routes) and the CLI, because each builds the one object
with lily.sampling.sampling_params and SamplingParams alone holds the rule; the server's narrower OpenAI limits say
that they are the API's."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import NO_THINKING, ServerThread, echo, scripted_model
from tokenizer_fixture import write_tiny_tokenizer

import lily
from lily import cli
from lily.sampling import SamplingParamError, SamplingParams
from lily.server.adapter import LilyEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]

# (field, a value SamplingParams refuses, the CLI flag that sets it)
BAD_FIELDS = [
    ("temperature", -1.5, "--temperature"),
    ("top_p", 1.5, "--top-p"),
    ("top_k", -3, "--top-k"),
    ("min_p", 2.0, "--min-p"),
    ("repetition_penalty", 0.0, "--repetition-penalty"),
    ("max_tokens", 0, "--max-tokens"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return scripted_model(write_tiny_tokenizer(tmp_path_factory.mktemp("entry-points-tokenizer")), echo)


@pytest.fixture(scope="module")
def http(model):
    with ServerThread(LilyEngine(model, model_id="scripted")) as running:
        with httpx.Client(base_url=running.base_url, timeout=10) as client:
            yield client


def rule_message(field: str, value: object) -> str:
    """The message of SamplingParams' one rule for `field`."""
    with pytest.raises(SamplingParamError) as refused:
        SamplingParams(**{field: value})
    assert refused.value.field == field
    return str(refused.value)


@pytest.mark.parametrize("field, value, flag", BAD_FIELDS, ids=[f for f, _, _ in BAD_FIELDS])
def test_a_bad_field_gets_the_same_message_at_every_entry(model, http, monkeypatch, capsys, field, value, flag):
    message = rule_message(field, value)
    assert message.startswith(f"{field} must be ") and message.endswith(f"; got {value!r}")
    for call, name in ((lambda: model.generate("hi", **{field: value}), "Model.generate"),
                       (lambda: model.chat(MESSAGES, **{field: value}), "Model.chat"),
                       (lambda: model.prefill("hi").decode(**{field: value}), "Session.decode"),
                       (lambda: model.sampling_params(**{field: value}), "Model.sampling_params")):
        with pytest.raises(ValueError) as refused:
            call()
        assert str(refused.value) == f"{name}(): {message}"
    for path, body in ((CHAT, {"messages": MESSAGES, **NO_THINKING}), (COMPLETIONS, {"prompt": "hi"})):
        reply = http.post(path, json={**body, field: value})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["message"], error["param"]) == (message, field)
    monkeypatch.setattr(lily.Model, "load", classmethod(lambda cls, *a, **k: model))
    assert cli.main(["generate", "hi", f"{flag}={value}"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"lily: error: Model.sampling_params(): {message}"


def test_the_server_names_the_api_limits_it_adds(model, http):
    """temperature 2.5 is Lily's to take (Model.generate samples with it) but over the OpenAI API's limit."""
    assert model.generate("hi", temperature=2.5, max_tokens=2, seed=0).token_ids
    reply = http.post(CHAT, json={"messages": MESSAGES, **NO_THINKING, "temperature": 2.5})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "temperature must be at most 2 (the OpenAI API's limit); got 2.5"
    reply = http.post(CHAT, json={"messages": MESSAGES, **NO_THINKING, "max_completion_tokens": 0})
    error = reply.json()["error"]
    assert (error["param"], error["message"]) == ("max_completion_tokens",
                                                  "max_completion_tokens must be an integer >= 1 or None; got 0")


def test_one_object_goes_down_and_keyword_arguments_build_it_once(model):
    """generate(sampling=...) decodes with the object given (checked against the model, never rebuilt); it and
    keyword arguments are one or the other."""
    params = model.sampling_params(temperature=0, max_tokens=3, stop_token_ids=[])
    assert isinstance(params, SamplingParams) and params.max_tokens == 3 and params.stop_token_ids == ()
    by_keywords = model.generate("hi", temperature=0, max_tokens=3, stop_token_ids=[])
    assert model.generate("hi", sampling=params).token_ids == by_keywords.token_ids
    with pytest.raises(TypeError, match=r"Model\.generate\(\) takes sampling= or sampling keyword arguments"):
        model.generate("hi", sampling=params, temperature=1.0)
    with pytest.raises(ValueError, match=r"Session\.decode\(\): max_tokens must be at most the model's context"):
        model.prefill("hi").decode(SamplingParams(max_tokens=10**6))
    assert SamplingParams().stop_token_ids is None  # the model's end tokens, resolved by the session
