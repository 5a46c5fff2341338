"""Rules with one implementation: a second copy, or a caller that stops using the one, fails here.

bf16 rounding lives in ``lily.quant`` (round to nearest even, NaN kept NaN); the token-id check of a backend's
``forward`` in ``lily.reference.check_token_ids``; the reading of kernel host names from Metal source in
``tools/msl_text.py``; the model's layer in one builder (the specification and the checkpoint reader aside).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import quant
from lily.backends import engine
from lily.kernel_cases import common as kernel_case_io

ROOT = Path(__file__).resolve().parents[1]


def kernel_io():
    """tests/kernels/conftest.py's KernelIO (tests/kernels is not a package, and its conftest is not importable)."""
    spec = importlib.util.spec_from_file_location("kernel_tests_conftest", ROOT / "tests" / "kernels" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.KernelIO()


def python_sources() -> list[Path]:
    return sorted([*(ROOT / "python").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])


def files_matching(pattern: str, under: str = "") -> list[str]:
    this = Path(__file__).resolve()
    return [str(p.relative_to(ROOT)) for p in python_sources()
            if p != this and str(p.relative_to(ROOT)).startswith(under) and re.search(pattern, p.read_text())]


def test_bf16_rounding_is_written_once() -> None:
    """The round-to-nearest-even bias 0x7FFF appears only in lily/quant.py."""
    assert files_matching(r"(?i)0x7fff\b") == ["python/lily/quant.py"]


# Every way Python code turns float32 into bf16 bits for a kernel or the engine.
BF16_CONVERTERS = {
    "lily.quant": quant.float32_to_bfloat16_bits,
    "engine backend weights": lambda x: engine._as_dtype(x, "bfloat16"),
    "kernel case buffers": lambda x: kernel_case_io.to_device(x, "bf16"),
    "kernel test buffers": lambda x: kernel_io().to_device(x, "bf16"),
}


@pytest.mark.parametrize("where", list(BF16_CONVERTERS))
def test_every_bf16_conversion_rounds_to_nearest_even_and_keeps_nan(where: str) -> None:
    # NaNs whose mantissa would carry into the exponent when rounded: the all-ones payload and a signalling NaN.
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], dtype=np.uint32).view(np.float32)
    numbers = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, np.inf, -np.inf, 3.4e38, 2**-130],
                       dtype=np.float32)
    # Ties to even: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6; above the tie rounds up; 3.4e38 overflows to inf.
    expected = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, np.inf, -np.inf, np.inf, 2**-130], dtype=np.float32)
    convert = BF16_CONVERTERS[where]
    widened = quant.bfloat16_bits_to_float32(np.asarray(convert(numbers)).view(np.uint16))
    np.testing.assert_array_equal(widened, expected)
    with np.errstate(invalid="ignore"):  # widening a signalling NaN to float64 raises the invalid flag
        widened_nans = quant.bfloat16_bits_to_float32(np.asarray(convert(nans)).view(np.uint16))
    assert np.isnan(widened_nans).all(), f"{where}: NaNs became {widened_nans}"


def test_token_id_check_is_written_once() -> None:
    """Backends validate token ids with lily.reference.check_token_ids; no other copy of its message exists."""
    assert files_matching(r"token_ids must (lie|be a non-empty)", "python/") == ["python/lily/reference.py"]
    assert "check_token_ids(" in Path(engine.__file__).read_text()


def test_tool_call_arguments_are_normalised_by_lily_chat() -> None:
    """The chat template's message normalisation decodes tool-call arguments with lily.chat.tool_call_arguments."""
    from lily.chat import tool_call_arguments
    from lily.tokenizer import normalize_messages

    def history(arguments) -> list[dict]:
        call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]

    for raw in ('{"a": [1, 2]}', {"a": [1, 2]}, "", None):
        (message,) = normalize_messages(history(raw))
        assert message["tool_calls"][0]["function"]["arguments"] == tool_call_arguments(raw)
    assert tool_call_arguments('{"a": [1, 2]}') == {"a": [1, 2]} and tool_call_arguments(None) == {}
    for bad, why in (("[1]", "expected a JSON object, got list"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=re.escape(why)):
            tool_call_arguments(bad)
        with pytest.raises(ValueError, match=re.escape(f"messages[0].tool_calls[0].function.arguments: {why}")):
            normalize_messages(history(bad))
    for user in ("tokenizer.py", "server/requests.py"):  # both call lily.chat.tool_call_arguments
        assert "json.loads(arguments" not in (ROOT / "python" / "lily" / user).read_text()


# What a reader of kernel host names matches, as written in a Python or C++ regular expression: the `[[host_name("x")]]`
# attribute, metal/lily.h's LILY_INSTANTIATE_KERNEL("x", ...) or the `[[kernel]]` attribute of a plain kernel.
HOST_NAME_READER = re.compile(r"host_name\)?\\s\*\\\(|LILY_INSTANTIATE(\(\?:_EARLY\)\?)?_KERNEL\)?\\s\*\\\(|"
                              r"\\\[\\\[\\s\*kernel")


def test_kernel_host_names_are_read_once() -> None:
    """tools/msl_text.py alone reads host names from kernel sources: the harness registration and the extension's
    kernel lists (tools/msl2cpu.py), the rules check and the tests import it; no other file has a pattern for them."""
    this = Path(__file__).resolve()
    sources = [*python_sources(), *(ROOT / "tools").glob("*.py"), *(ROOT / "src").rglob("*.cpp"),
               *(ROOT / "src").rglob("*.h")]
    readers = [str(p.relative_to(ROOT)) for p in sources if p != this and HOST_NAME_READER.search(p.read_text())]
    assert readers == ["tools/msl_text.py"]


def test_the_layer_is_written_in_one_builder() -> None:
    """Issue 22: the DeltaNet projection's checkpoint name appears only in the specification (lily/reference.py), the
    checkpoint reader (lily/checkpoint.py) and the one model builder (src/lily_ext/models/qwen3_5_moe.cpp)."""
    sources = [p for folder in ("src", "python") for p in (ROOT / folder).rglob("*")
               if p.suffix in {".py", ".cpp", ".h", ".metal", ".mm"} and "in_proj_qkv" in p.read_text(errors="ignore")]
    assert sorted(p.relative_to(ROOT).as_posix() for p in sources) == [
        "python/lily/checkpoint.py", "python/lily/reference.py", "src/lily_ext/models/qwen3_5_moe.cpp"]
