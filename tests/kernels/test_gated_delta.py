"""metal/gated_delta.metal (the decode step) through the CPU harness, against lily.reference.gated_delta; also the
shared fixtures of the op family (the prefill kernels are tested in test_gated_delta_prefill.py).

The reference (conv + SiLU, q/k L2 norms with q times dk^-0.5, gates, the delta rule, the gated RMSNorm) runs on the
kernel's exact inputs. Shapes keep Dk = 128 (the kernel's template parameter) and the model's head grouping (Hv/Hk =
2), with smaller dv and head counts; they also cover Hv/Hk = 1 and 4, rows that do not divide evenly over the
simdgroups and the full 256-row key head, from random conv and recurrent states. The Dk = 64 instances (demo model
and fixtures: Hk 2, Hv 4 or 6, dv 64) run decode steps. Outputs start NaN-poisoned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily._ext import msl

DK = 128
K = 4
EPS = 1e-6
DTYPES = ["f32", "bf16"]
STEP = {"f32": "gated_delta_step_f32_dk128", "f16": "gated_delta_step_f16_dk128", "bf16": "gated_delta_step_bf16_dk128"}
CONV = {"f32": "gated_delta_conv_f32_dk128", "f16": "gated_delta_conv_f16_dk128", "bf16": "gated_delta_conv_bf16_dk128"}
PREFILL = {
    "f32": "gated_delta_prefill_f32_dk128",
    "bf16": "gated_delta_prefill_bf16_dk128",
}
STEP_DK64 = {"f32": "gated_delta_step_f32_dk64", "bf16": "gated_delta_step_bf16_dk64"}
CONV_DK64 = {"f32": "gated_delta_conv_f32_dk64", "bf16": "gated_delta_conv_bf16_dk64"}
PREFILL_DK64 = {"f32": "gated_delta_prefill_f32_dk64", "bf16": "gated_delta_prefill_bf16_dk64"}
# The REGISTER_SCAN ablation, instantiated for the engine's modes only (f32, bf16); keyed by (dtype, Dk).
BLOCKWISE = {
    ("f32", 128): "gated_delta_prefill_blockwise_f32_dk128",
    ("bf16", 128): "gated_delta_prefill_blockwise_bf16_dk128",
    ("f32", 64): "gated_delta_prefill_blockwise_f32_dk64",
    ("bf16", 64): "gated_delta_prefill_blockwise_bf16_dk64",
}
SCAN_BLOCK = 16  # LILY_GDN_SCAN_BLOCK (metal/lily.h): tokens between the blockwise kernel's state round trips
# The kernels compute in fp32 from rounded inputs and round once: bf16/f16 outputs are within 1 ulp of the rounded
# reference. fp32 outputs go through ~10 dependent fp32 operations per token, so they get a few ulp, not one.
F32_CHAIN = {"rtol": 3e-5, "atol": 3e-6, "rel_rms": 5e-6}


def gdn_args(num_tokens: int, hk: int, hv: int, dv: int, l2_eps: float = EPS, norm_eps: float = EPS) -> bytes:
    """lily::GatedDeltaArgs (metal/lily.h): T, Hk, Hv, dv, l2_eps, norm_eps, two u32 of padding."""
    return struct.pack("<IIIIffII", num_tokens, hk, hv, dv, l2_eps, norm_eps, 0, 0)


@dataclass
class Layer:
    """One layer's device buffers (kernel storage dtype) and its state."""

    hk: int
    hv: int
    dv: int
    dtype: str
    conv_weight: np.ndarray  # [C, K]
    a_log: np.ndarray  # [Hv] f32
    dt_bias: np.ndarray  # [Hv] f32
    norm_weight: np.ndarray  # [dv]
    conv_state: np.ndarray  # [K-1, C]
    state: np.ndarray  # [Hv, dv, Dk] f32 (kernel layout)
    dk: int = DK  # the kernel instance's key head dim

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    def kernel(self, family: str) -> str:
        """The instance of `family` ("step", "conv", "prefill" or "blockwise") for this layer's dtype and Dk."""
        if family == "blockwise":
            return BLOCKWISE[(self.dtype, self.dk)]
        if self.dk == DK:
            return {"step": STEP, "conv": CONV, "prefill": PREFILL}[family][self.dtype]
        return {"step": STEP_DK64, "conv": CONV_DK64, "prefill": PREFILL_DK64}[family][self.dtype]


def make_layer(rng: np.random.Generator, hk: int, hv: int, dv: int, dtype: str, kio, fresh: bool = False,
               dk: int = DK) -> Layer:
    c = 2 * hk * dk + hv * dv
    conv_state = np.zeros((K - 1, c)) if fresh else rng.standard_normal((K - 1, c))
    state = np.zeros((hv, dv, dk)) if fresh else 0.3 * rng.standard_normal((hv, dv, dk))
    return Layer(
        hk, hv, dv, dtype,
        conv_weight=kio.to_device(0.5 * rng.standard_normal((c, K)), dtype),
        a_log=np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32),
        dt_bias=rng.standard_normal(hv).astype(np.float32),
        norm_weight=kio.to_device(1.0 + 0.2 * rng.standard_normal(dv), dtype),
        conv_state=kio.to_device(conv_state, dtype),
        state=np.ascontiguousarray(state, dtype=np.float32),
        dk=dk,
    )


def make_tokens(rng: np.random.Generator, layer: Layer, num_tokens: int, kio) -> dict[str, np.ndarray]:
    """Projection outputs of `num_tokens` tokens: raw qkv, z, b, a (a spread to reach both softplus branches)."""
    t, d = num_tokens, layer.dtype
    return {
        "qkv": kio.to_device(rng.standard_normal((t, layer.channels)), d),
        "z": kio.to_device(2.0 * rng.standard_normal((t, layer.hv * layer.dv)), d),
        "b": kio.to_device(2.0 * rng.standard_normal((t, layer.hv)), d),
        "a": kio.to_device(8.0 * rng.standard_normal((t, layer.hv)), d),
    }


def reference_chain(layer: Layer, tokens: dict[str, np.ndarray], kio):
    """lily.reference.gated_delta over the widened kernel inputs: out [T, Hv*dv], conv state [K-1, C], state
    [Hv, dv, Dk] (the kernel's layout, the transpose of the reference's)."""
    d = layer.dtype
    weights = {"conv1d.weight": kio.to_f64(layer.conv_weight, d), "A_log": layer.a_log, "dt_bias": layer.dt_bias,
               "norm.weight": kio.to_f64(layer.norm_weight, d)}
    y, conv_state, state = reference.gated_delta(
        *(kio.to_f64(tokens[name], d) for name in ("qkv", "z", "b", "a")), weights, kio.to_f64(layer.conv_state, d),
        layer.state.transpose(0, 2, 1), num_k_heads=layer.hk, num_v_heads=layer.hv, head_k_dim=layer.dk,
        head_v_dim=layer.dv, eps=EPS)
    return y, conv_state, state.transpose(0, 2, 1)


def prefill_threads(layer: Layer, extra_simdgroups: int = 0) -> int:
    """gated_delta_prefill keeps at most 8 rows per simdgroup: dv <= 8 * simdgroups."""
    return 32 * (-(-layer.dv // 8) + extra_simdgroups)


def run_step(layer: Layer, token: dict[str, np.ndarray], threads: int, kio, seed: int = 0) -> np.ndarray:
    """One gated_delta_step dispatch (token arrays are [1, ...]); updates layer.conv_state/state in place."""
    out = kio.poisoned((1, layer.hv * layer.dv), layer.dtype)
    msl.dispatch(
        layer.kernel("step"),
        [gdn_args(1, layer.hk, layer.hv, layer.dv), token["qkv"], token["z"], token["b"], token["a"],
         layer.conv_weight, layer.a_log, layer.dt_bias, layer.norm_weight, layer.conv_state, layer.state, out],
        (layer.hk, 1, 1), (threads, 1, 1), seed=seed,
    )
    return out


def run_prefill(layer: Layer, tokens: dict[str, np.ndarray], threads: int, kio, seed: int = 0,
                scan: str = "prefill") -> np.ndarray:
    """gated_delta_conv then the `scan` kernel ("prefill" or "blockwise") over one chunk; updates the layer's states
    in place."""
    t = tokens["qkv"].shape[0]
    conv_out = np.full((t, layer.channels), np.nan, np.float32)
    args = gdn_args(t, layer.hk, layer.hv, layer.dv)
    msl.dispatch(layer.kernel("conv"), [args, tokens["qkv"], layer.conv_weight, layer.conv_state, conv_out],
                 (-(-layer.channels // 64), 1, 1), (64, 1, 1), seed=seed)
    out = kio.poisoned((t, layer.hv * layer.dv), layer.dtype)
    msl.dispatch(
        layer.kernel(scan),
        [args, conv_out, tokens["z"], tokens["b"], tokens["a"], layer.a_log, layer.dt_bias, layer.norm_weight,
         layer.state, out],
        (layer.hv, 1, 1), (threads, 1, 1), seed=seed,
    )
    return out


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: str, what: str, kio) -> None:
    if dtype != "f32":
        kio.assert_close(actual, expected, dtype, what)
        return
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert not np.isnan(a).any(), f"{what}: NaN in the output"
    rel_rms = np.sqrt(np.mean((a - e) ** 2) / np.mean(e * e))
    assert rel_rms <= F32_CHAIN["rel_rms"], f"{what}: relative RMS error {rel_rms:.3g}"
    err, limit = np.abs(a - e), F32_CHAIN["atol"] + F32_CHAIN["rtol"] * np.abs(e)
    worst = np.unravel_index(np.argmax(err - limit), a.shape)
    assert (err <= limit).all(), f"{what}: max abs error {err.max():.3g} at {worst}"


def check_against_reference(layer: Layer, start: Layer, tokens, outputs: np.ndarray, kio, what: str) -> None:
    y, conv_state, state = reference_chain(start, tokens, kio)
    assert_close(kio.to_f64(outputs, layer.dtype), kio.round(y, layer.dtype), layer.dtype, f"{what} output", kio)
    assert np.array_equal(kio.to_f64(layer.conv_state, layer.dtype), conv_state), f"{what}: conv state"
    # fp32 state against an fp32 reference with fp64 sums: a few ulp of the state's scale, over up to 0.5 M elements.
    scale = np.sqrt(np.mean(state.astype(np.float64) ** 2))
    np.testing.assert_allclose(layer.state, state, rtol=4e-6, atol=2e-5 * scale, err_msg=f"{what}: recurrent state")


def copy_layer(layer: Layer) -> Layer:
    return Layer(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in layer.__dict__.items()})


# (Hk, Hv, dv, step threads): the model's grouping with small dv; one full 256-row key head at 1024 threads; Hv/Hk 1
# and 4; one simdgroup for all rows; 33 rows per head over 3 simdgroups (uneven round-robin).
CONFIGS = [(1, 2, 32, 64), (2, 4, 33, 96), (1, 2, 128, 1024), (1, 1, 64, 32), (1, 4, 32, 256)]
CONFIG_IDS = [f"hk{a}-hv{b}-dv{c}-t{d}" for a, b, c, d in CONFIGS]


@pytest.mark.parametrize("hk,hv,dv,threads", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_step(dtype: str, hk: int, hv: int, dv: int, threads: int, kio) -> None:
    """Two decode steps from random states against the reference over the same two tokens."""
    rng = np.random.default_rng(10 * CONFIGS.index((hk, hv, dv, threads)) + DTYPES.index(dtype))
    layer = make_layer(rng, hk, hv, dv, dtype, kio)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, 2, kio)
    outs = [run_step(layer, {n: x[t : t + 1] for n, x in tokens.items()}, threads, kio, seed=t) for t in range(2)]
    check_against_reference(layer, start, tokens, np.concatenate(outs), kio, f"{STEP[dtype]} {hk}/{hv}/{dv}")


def test_gated_delta_step_extreme_gates(kio) -> None:
    """Large |a| and |b| (softplus threshold, decay 0 or 1, beta 0 or 1) and a zero key stay finite and right."""
    rng = np.random.default_rng(77)
    layer = make_layer(rng, 1, 2, 32, "f32", kio)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, 1, kio)
    tokens["a"][:] = np.array([[40.0, -40.0]], np.float32)
    tokens["b"][:] = np.array([[30.0, -30.0]], np.float32)
    tokens["qkv"][0, DK : 2 * DK] = 0.0  # all-zero key channels: the L2 eps keeps k finite (zero write)
    layer.conv_state[:, DK : 2 * DK] = 0.0
    start.conv_state[:, DK : 2 * DK] = 0.0
    out = run_step(layer, tokens, 64, kio)
    check_against_reference(layer, start, tokens, out, kio, "extreme gates")


@pytest.mark.parametrize("seed", [1, 2])
def test_gated_delta_step_independent_of_schedule(seed: int, kio) -> None:
    rng = np.random.default_rng(8)
    base = make_layer(rng, 1, 2, 32, "f32", kio)
    tokens = make_tokens(rng, base, 1, kio)
    results = []
    for random_schedule in (False, True):
        layer = copy_layer(base)
        out = kio.poisoned((1, layer.hv * layer.dv), "f32")
        msl.dispatch(STEP["f32"],
                     [gdn_args(1, 1, 2, 32), tokens["qkv"], tokens["z"], tokens["b"], tokens["a"], layer.conv_weight,
                      layer.a_log, layer.dt_bias, layer.norm_weight, layer.conv_state, layer.state, out],
                     (1, 1, 1), (96, 1, 1), random_schedule=random_schedule, seed=seed)
        results.append((out, layer.state))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


def test_model_size_layer_bf16(kio) -> None:
    """The real layer shape (Hk 16, Hv 32, dk = dv = 128, C = 8192): one decode step, then a 2-token prefill chunk."""
    rng = np.random.default_rng(2026)
    layer = make_layer(rng, 16, 32, 128, "bf16", kio)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, 3, kio)
    first = run_step(layer, {n: x[:1] for n, x in tokens.items()}, 1024, kio)
    rest = run_prefill(layer, {n: x[1:] for n, x in tokens.items()}, prefill_threads(layer), kio)
    check_against_reference(layer, start, tokens, np.concatenate([first, rest]), kio, "model-size layer")


# (Hk, Hv, dv, step threads): the demo model (2/4/64) at the engine's 8 rows per simdgroup (16 simdgroups), the gqa4
# fixture (Hv/Hk = 3), one simdgroup for all 128 rows of a key head.
DK64_CONFIGS = [(2, 4, 64, 512), (2, 6, 64, 768), (1, 2, 64, 32)]


@pytest.mark.parametrize("hk,hv,dv,threads", DK64_CONFIGS,
                         ids=[f"hk{a}-hv{b}-dv{c}-t{d}" for a, b, c, d in DK64_CONFIGS])
@pytest.mark.parametrize("dtype", list(STEP_DK64))
def test_gated_delta_step_dk64(dtype: str, hk: int, hv: int, dv: int, threads: int, kio) -> None:
    """Two decode steps of the Dk = 64 instance from random states against the reference."""
    rng = np.random.default_rng(400 + 10 * DK64_CONFIGS.index((hk, hv, dv, threads)) + DTYPES.index(dtype))
    layer = make_layer(rng, hk, hv, dv, dtype, kio, dk=64)
    start = copy_layer(layer)
    tokens = make_tokens(rng, layer, 2, kio)
    outs = [run_step(layer, {n: x[t : t + 1] for n, x in tokens.items()}, threads, kio, seed=t) for t in range(2)]
    check_against_reference(layer, start, tokens, np.concatenate(outs), kio, f"{STEP_DK64[dtype]} {hk}/{hv}/{dv}")


@pytest.mark.parametrize("case", op_cases("gated_delta"))
def test_gated_delta_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.gated_delta: the self-test's, on this session's device."""
    check(case, kernel_device)
