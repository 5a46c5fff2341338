"""What crosses into the compiled engines typed: the configuration (lily.backends.engine_config -> _ext.ModelConfig,
for the metal, cuda and cpu engines alike), the switches (engine_switches -> _ext.Switches) and the GPU token choice
(token_choice -> _ext.TokenChoice), each built by one Python function."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures import TINY_CONFIGS

from lily import _ext
from lily.backends import ENGINE_CONFIG_FIELDS, engine_config
from lily.backends.engine import SWITCHES, TEST_OPTIONS, engine_switches, token_choice
from lily.config import FULL_SIZE_CONFIG, ModelArgs
from lily.sampling import SamplingParams

CONFIGS = {"full size": FULL_SIZE_CONFIG,
           **{name: {**text, "model_type": "qwen3_5_moe_text"} for name, text in TINY_CONFIGS.items()}}


def bound_fields(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_typed_config_round_trips_every_field_the_engine_reads(name):
    args = ModelArgs.from_dict(CONFIGS[name], source=name)
    config = engine_config(args)
    for field in ENGINE_CONFIG_FIELDS:
        want = getattr(args, field)
        if isinstance(want, float):
            want = float(np.float32(want))  # lily::ModelConfig holds float32
        elif field == "layer_types":
            want = list(want)
        assert getattr(config, field) == want, field


def test_the_binding_and_the_builder_name_the_same_fields():
    """Every field lily._ext.ModelConfig binds is one engine_config sets from ModelArgs, so none keeps its C++
    default unseen."""
    assert bound_fields(_ext.ModelConfig) == set(ENGINE_CONFIG_FIELDS)
    args = ModelArgs.from_dict(FULL_SIZE_CONFIG, source="full size")
    assert all(hasattr(args, field) for field in ENGINE_CONFIG_FIELDS)


def test_a_value_the_config_cannot_hold_names_the_field():
    args = ModelArgs.from_dict(FULL_SIZE_CONFIG, source="full size")
    with pytest.raises(ValueError, match=r"engine config: head_dim must be a non-negative integer; got -1"):
        engine_config(dataclasses.replace(args, head_dim=-1))
    with pytest.raises(ValueError, match=r"layer_types: unknown layer type 'sliding'"):
        engine_config(dataclasses.replace(args, layer_types=("sliding",) * len(args.layer_types)))
    with pytest.raises(RuntimeError, match="num_key_value_heads"):  # the engine's own shape check names it too
        _ext.plan_decode(engine_config(dataclasses.replace(args, num_key_value_heads=3)), 8)


def test_switches_cross_typed_and_refuse_what_they_do_not_know():
    assert bound_fields(_ext.Switches) == set(SWITCHES) | set(TEST_OPTIONS)
    default = engine_switches({})
    assert all(getattr(default, name) is True for name in SWITCHES)
    chosen = engine_switches({"fusion": False, "kv_block": 7})
    assert chosen.fusion is False and chosen.kv_block == 7 and chosen.gqa_packing is True
    with pytest.raises(ValueError, match=r"engine switch 'fusion' must be True or False; got 0"):
        engine_switches({"fusion": 0})
    with pytest.raises(ValueError, match=r"engine option 'kv_block' must be an integer >= 0; got -1"):
        engine_switches({"kv_block": -1})
    with pytest.raises(ValueError, match=r"unknown engine switch 'turbo'"):
        engine_switches({"turbo": False})


def test_the_token_choice_carries_every_sampling_field_the_gpu_reads():
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=1.5, frequency_penalty=-0.5, seed=-1)
    choice = token_choice(params, params.seed)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert getattr(choice, name) == float(np.float32(getattr(params, name))), name
    assert choice.top_k == 40 and choice.seed == 2**64 - 1
    assert token_choice(SamplingParams(top_k=2**40), 0).top_k == 2**32 - 1  # beyond the vocabulary: off either way
