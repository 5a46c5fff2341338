"""Checkpoint loading: memory-mapped safetensors, the HF and MLX layouts, sharding, bad input.

``load_checkpoint(path)`` maps a checkpoint directory onto the canonical tensor names of
docs/architecture.md without reading the weights: each tensor is read (and converted to fp32,
split, stacked, shifted by +1 or quantized) only when a consumer asks for it, so the whole model
is never materialised.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Union

import numpy as np

from lily import quant
from lily.config import FULL_ATTENTION, ConfigError, ModelArgs, eos_id_list, read_json_object
from lily.quant import QuantizedTensor

Tensor = Union[np.ndarray, QuantizedTensor]

# safetensors dtype -> numpy dtype of the raw memory-mapped view (bf16 is kept as its bit pattern).
_RAW_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MAX_HEADER_BYTES = 100 << 20

# Prefixes of tensors that a text-only engine ignores (vision tower, multi-token prediction).
_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "vision_tower.", "model.vision_tower.", "model.mtp.")
# Prefixes of the text model, longest first: real HF, MLX-sanitised, text-only HF.
_TEXT_PREFIXES = (
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("model.", ""),
)
# Norms that HF stores as w (applied as 1 + w) and MLX/Lily store as 1 + w.
_SHIFTED_NORM = re.compile(
    r"^(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))\.weight$"
)
# Canonical modules that mlx-lm's predicate quantizes at 8 bits.
_EIGHT_BIT = re.compile(r"\.mlp\.(gate|shared_expert_gate)\.weight$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names file and tensor."""


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes live: ``offset`` is absolute in ``file``; ``dtype`` is safetensors'."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class SafetensorsFile:
    """A safetensors file: its header parsed and validated, tensors memory-mapped on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
                header_len = int.from_bytes(prefix, "little")
                if header_len > min(size - 8, _MAX_HEADER_BYTES):
                    raise CheckpointError(
                        f"{self.path}: corrupt safetensors header (declares {header_len} header bytes, "
                        f"file has {size})"
                    )
                raw_header = f.read(header_len)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        try:
            header = json.loads(raw_header.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: expected a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.tensors: dict[str, TensorLocation] = {
            name: self._location(name, entry, size) for name, entry in header.items()
        }
        self._mmap: np.memmap | None = None

    def _location(self, name: str, entry: Any, size: int) -> TensorLocation:
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name!r}: {what}")

        if not isinstance(entry, dict):
            raise bad("entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _RAW_DTYPES:
            raise bad(f"unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise bad(f"bad shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"bad data_offsets {offsets!r}")
        nbytes = math.prod(shape) * _RAW_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise bad(
                f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, shape {shape} {dtype} needs {nbytes}"
            )
        end = self.data_start + offsets[1]
        if end > size:
            raise CheckpointError(
                f"{self.path}: truncated file: tensor {name!r} ends at byte {end} but the file has {size} bytes"
            )
        return TensorLocation(self.path, self.data_start + offsets[0], nbytes, dtype, tuple(shape))

    def raw(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (bf16 as uint16 bit patterns)."""
        loc = self.tensors[name]
        dtype = _RAW_DTYPES[loc.dtype]
        if loc.nbytes == 0:
            return np.zeros(loc.shape, dtype)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[loc.offset : loc.offset + loc.nbytes].view(dtype).reshape(loc.shape)


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values of a raw tensor view; a zero-copy view when it is already fp32."""
    if dtype == "BF16":
        return quant.bfloat16_bits_to_float32(raw)
    if dtype == "F32":
        return np.asarray(raw)
    return np.asarray(raw, dtype=np.float32)


# --- sources: how one canonical tensor is produced from the files -----------------------------


@dataclass(frozen=True)
class _Part:
    file: SafetensorsFile
    name: str

    @property
    def loc(self) -> TensorLocation:
        return self.file.tensors[self.name]

    def float32(self, rows: slice | None = None) -> np.ndarray:
        raw = self.file.raw(self.name)
        if rows is not None:
            raw = raw[..., rows, :]
        return _to_float32(raw, self.loc.dtype)


@dataclass(frozen=True)
class _Dense:
    """A float tensor: reshaped (conv1d), row-sliced (fused experts) or shifted by +1 (HF norms)."""

    part: _Part
    shape: tuple[int, ...]
    rows: slice | None = None
    add_one: bool = False

    @property
    def dtype(self) -> str:
        return _FLOAT_DTYPES[self.part.loc.dtype]

    def load(self) -> np.ndarray:
        out = self.part.float32(self.rows).reshape(self.shape)
        return out + np.float32(1.0) if self.add_one else out

    def locations(self) -> dict[str, TensorLocation] | None:
        if self.rows is not None or self.add_one:
            return None
        return {"weight": replace(self.part.loc, shape=self.shape)}


@dataclass(frozen=True)
class _Stacked:
    """Per-expert 2-D tensors stacked into ``[E, out, in]``."""

    parts: tuple[_Part, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return _FLOAT_DTYPES[self.parts[0].loc.dtype]

    def load(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        for e, part in enumerate(self.parts):
            out[e] = part.float32()
        return out

    def locations(self) -> None:
        return None


@dataclass(frozen=True)
class _Quantized:
    """An MLX affine-quantized tensor stored as ``weight`` (uint32), ``scales``, ``biases``."""

    weight: _Part
    scales: _Part
    biases: _Part
    bits: int
    group_size: int
    shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return _FLOAT_DTYPES[self.scales.loc.dtype]

    def load(self) -> QuantizedTensor:
        return QuantizedTensor(
            np.asarray(self.weight.file.raw(self.weight.name)),
            self.scales.float32(),
            self.biases.float32(),
            self.bits,
            self.group_size,
            self.dtype,
        )

    def locations(self) -> dict[str, TensorLocation]:
        return {"weight": self.weight.loc, "scales": self.scales.loc, "biases": self.biases.loc}


@dataclass(frozen=True)
class _QuantizeOnLoad:
    """A dense source quantized on access exactly as mlx_lm.convert would quantize it."""

    source: Union[_Dense, _Stacked]
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def dtype(self) -> str:
        return self.source.dtype

    def load(self) -> QuantizedTensor:
        return quant.quantize(self.source.load(), self.bits, self.group_size, dtype=self.source.dtype)

    def locations(self) -> None:
        return None


_Source = Union[_Dense, _Stacked, _Quantized, _QuantizeOnLoad]


def _read_only(tensor: Tensor) -> Tensor:
    arrays = (tensor.weight, tensor.scales, tensor.biases) if isinstance(tensor, QuantizedTensor) else (tensor,)
    for array in arrays:
        array.flags.writeable = False
    return tensor


class Weights(Mapping[str, Tensor]):
    """Canonical name -> read-only tensor, read (converted, quantized) on access.

    While a consumer holds a tensor, further accesses return the same object; once it is
    dropped, the next access reads it again. Nothing else is kept in memory.
    """

    def __init__(self, sources: dict[str, _Source]) -> None:
        self._sources = sources
        self._alive: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()

    def __getitem__(self, name: str) -> Tensor:
        tensor = self._alive.get(name)
        if tensor is None:
            tensor = _read_only(self._sources[name].load())
            self._alive[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape of a tensor, without reading it."""
        return tuple(self._sources[name].shape)

    def dtype(self, name: str) -> str:
        """Storage dtype ("bfloat16", "float16", "float32"); the scales' dtype if quantized."""
        return self._sources[name].dtype

    def is_quantized(self, name: str) -> bool:
        """Whether the tensor is a ``QuantizedTensor`` (stored quantized, quantized on load, or dummy quantized)."""
        return self.quantization(name) is not None

    def quantization(self, name: str) -> tuple[int, int] | None:
        """``(bits, group_size)`` of a quantized tensor, else None (a source is quantized when it has ``bits``)."""
        source = self._sources[name]
        bits = getattr(source, "bits", None)
        return None if bits is None else (bits, source.group_size)

    def locations(self, name: str) -> dict[str, TensorLocation] | None:
        """The on-disk bytes of a tensor: ``{"weight": ...}`` (plus ``"scales"``/``"biases"`` if
        quantized), or None when the canonical tensor is not a plain byte range of a file in its
        stored dtype (split fused experts, stacked experts, shifted norms, quantized on load)."""
        return self._sources[name].locations()


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: validated ``args``, lazily read canonical ``weights`` and file info."""

    path: Path
    args: ModelArgs
    weights: Weights
    format: str  # "hf" (HF names, w norms) or "mlx" (MLX-sanitised names, 1+w norms)
    files: tuple[Path, ...]
    tokenizer_dir: Path | None = None
    chat_template_path: Path | None = None
    generation_config: Mapping[str, Any] = field(default_factory=dict)


def canonical_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The canonical tensor names of a model with ``args`` and their logical shapes."""
    h, v = args.hidden_size, args.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, h),
        "norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    e, inter, shared = args.num_experts, args.moe_intermediate_size, args.shared_expert_intermediate_size
    for i, kind in enumerate(args.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == FULL_ATTENTION:
            q_width = args.num_attention_heads * args.head_dim
            kv_width = args.num_key_value_heads * args.head_dim
            shapes[p + "self_attn.q_proj.weight"] = (2 * q_width, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_width, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_width, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_width)
            shapes[p + "self_attn.q_norm.weight"] = (args.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (args.head_dim,)
        else:
            hv = args.linear_num_value_heads
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (args.conv_dim, h)
            shapes[p + "linear_attn.in_proj_z.weight"] = (args.linear_value_dim, h)
            shapes[p + "linear_attn.in_proj_b.weight"] = (hv, h)
            shapes[p + "linear_attn.in_proj_a.weight"] = (hv, h)
            shapes[p + "linear_attn.conv1d.weight"] = (args.conv_dim, args.linear_conv_kernel_dim)
            shapes[p + "linear_attn.dt_bias"] = (hv,)
            shapes[p + "linear_attn.A_log"] = (hv,)
            shapes[p + "linear_attn.norm.weight"] = (args.linear_value_head_dim,)
            shapes[p + "linear_attn.out_proj.weight"] = (h, args.linear_value_dim)
        shapes[p + "mlp.gate.weight"] = (e, h)
        shapes[p + "mlp.switch_mlp.gate_proj.weight"] = (e, inter, h)
        shapes[p + "mlp.switch_mlp.up_proj.weight"] = (e, inter, h)
        shapes[p + "mlp.switch_mlp.down_proj.weight"] = (e, h, inter)
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (shared, h)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (shared, h)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (h, shared)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def _is_quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """mlx-lm's rule: Linear / Embedding / SwitchLinear weights whose input dim fits the groups."""
    return len(shape) >= 2 and not name.endswith("conv1d.weight") and shape[-1] % group_size == 0


# --- quantization settings of an MLX config ---------------------------------------------------


@dataclass(frozen=True)
class _QuantSpec:
    bits: int
    group_size: int
    overrides: Mapping[str, Any]


def _quant_spec(quantization: Mapping[str, Any] | None, config_path: Path) -> _QuantSpec | None:
    if quantization is None:
        return None

    def check(entry: Mapping[str, Any], where: str) -> tuple[int, int]:
        mode = entry.get("mode", "affine")
        if mode != "affine":
            raise CheckpointError(
                f"{config_path}: {where}.mode: unsupported quantization mode {mode!r} (only 'affine')"
            )
        bits, group = entry.get("bits"), entry.get("group_size")
        if bits not in quant.SUPPORTED_BITS:
            raise CheckpointError(
                f"{config_path}: {where}.bits: unsupported quantization bits {bits!r} "
                f"(supported: {quant.SUPPORTED_BITS})"
            )
        if group not in quant.SUPPORTED_GROUP_SIZES:
            raise CheckpointError(
                f"{config_path}: {where}.group_size: unsupported quantization group size {group!r} "
                f"(supported: {quant.SUPPORTED_GROUP_SIZES})"
            )
        return bits, group

    if "quant_method" in quantization:
        raise CheckpointError(
            f"{config_path}: quantization_config.quant_method: unsupported quantization "
            f"{quantization['quant_method']!r}; Lily reads MLX affine checkpoints and unquantized ones"
        )
    bits, group = check(quantization, "quantization")
    overrides: dict[str, Any] = {}
    for key, value in quantization.items():
        if isinstance(value, Mapping):
            check({"mode": quantization.get("mode", "affine"), **value}, f"quantization[{key!r}]")
            overrides[key] = value
        elif value is False:
            overrides[key] = False
    return _QuantSpec(bits, group, overrides)


# --- directory layout --------------------------------------------------------------------------


def _tensor_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, if sharded, the index's weight_map."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json_object(index_path, CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: missing or invalid 'weight_map'")
        files = []
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if Path(shard).name != shard or not shard_path.is_file():
                tensor = next(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(
                    f"{index_path}: shard {shard!r} (holding {tensor!r}) does not exist in {directory}"
                )
            files.append(shard_path)
        return files, weight_map
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no .safetensors files (and no model.safetensors.index.json)")
    return files, None


def _canonical_name(raw: str) -> str | None:
    """The name without its text-model prefix; None for tensors a text engine skips."""
    if raw.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if raw.startswith(prefix):
            return replacement + raw[len(prefix) :]
    return raw


class _Builder:
    """Maps the raw tensors of one checkpoint onto canonical sources, validating as it goes."""

    def __init__(self, directory: Path, args: ModelArgs, quantize: int | None, spec: _QuantSpec | None) -> None:
        self.directory = directory
        self.quantize = quantize
        self.spec = spec
        self.expected = canonical_shapes(args)
        self.sources: dict[str, _Source] = {}
        self.per_expert: dict[str, dict[int, _Part]] = {}

    def where(self, part: _Part) -> str:
        return f"{part.file.path}: tensor {part.name!r}"

    def add(self, canonical: str, source: _Source, part: _Part) -> None:
        if canonical in self.sources:
            raise CheckpointError(f"{self.where(part)}: duplicate definition of {canonical!r}")
        self.sources[canonical] = source

    def check_float(self, part: _Part) -> None:
        if part.loc.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{self.where(part)}: wrong dtype {part.loc.dtype} (expected F32, F16 or BF16)")

    def check_shape(
        self, part: _Part, canonical: str, shape: tuple[int, ...], stored: tuple[int, ...] | None = None
    ) -> None:
        expected = self.expected[canonical]
        if tuple(shape) != expected:
            got = stored if stored is not None else shape
            raise CheckpointError(
                f"{self.where(part)}: wrong shape {list(got)}; expected {list(expected)} for {canonical!r}"
            )

    def unexpected(self, part: _Part) -> CheckpointError:
        return CheckpointError(f"{self.where(part)}: unexpected tensor (not part of this qwen3_5_moe text model)")

    def stored_name(self, canonical: str, parts: dict[str, _Part]) -> str:
        """``canonical`` as this checkpoint would name it, for messages about missing tensors."""
        for prefix, replacement in _TEXT_PREFIXES:
            if any(raw.startswith(prefix) for raw in parts):
                if canonical.startswith("lm_head.") and replacement != "lm_head.":
                    return ("language_model." if prefix.startswith("language_model.") else "") + canonical
                return prefix + canonical
        return canonical

    def build(self, parts: dict[str, _Part]) -> tuple[dict[str, _Source], str]:
        parts = {raw: part for raw, part in parts.items() if _canonical_name(raw) is not None}
        sanitized = self.is_sanitized(parts)
        quantized_modules = {n[: -len(".scales")] for n in parts if n.endswith(".scales")}
        if quantized_modules and self.spec is None:
            first = sorted(quantized_modules)[0]
            raise CheckpointError(
                f"{self.where(parts[first + '.scales'])}: quantized tensor but config.json has no 'quantization'"
            )
        if quantized_modules and self.quantize is not None:
            raise CheckpointError(
                f"{self.directory}: quantize={self.quantize} was requested but the checkpoint is already quantized"
            )
        for raw, part in parts.items():
            if raw.endswith((".scales", ".biases")):
                module = raw[: -len(".scales")]
                if module + ".weight" not in parts:
                    raise CheckpointError(f"{self.where(part)}: has no matching {module + '.weight'!r}")
                if module not in quantized_modules:
                    raise CheckpointError(f"{self.where(part)}: biases without scales")
                continue
            canonical = _canonical_name(raw)
            if raw.endswith(".weight") and raw[: -len(".weight")] in quantized_modules:
                self.add_quantized(canonical, raw[: -len(".weight")], parts)
            else:
                self.add_dense(canonical, part, sanitized)
        self.finish_per_expert()
        missing = [name for name in self.expected if name not in self.sources]
        if missing:
            raise CheckpointError(
                f"{self.directory}: missing tensor {self.stored_name(missing[0], parts)!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        ordered = {name: self.sources[name] for name in self.expected}
        if self.quantize is not None:
            ordered = {name: self.quantize_on_load(name, source) for name, source in ordered.items()}
        return ordered, "mlx" if sanitized else "hf"

    def is_sanitized(self, parts: dict[str, _Part]) -> bool:
        """Whether norms are stored as 1 + w: mlx-lm's rule (conv1d already [C, K, 1]), or the
        MLX name prefix when the model has no conv layers."""
        convs = {n: p.loc.shape for n, p in parts.items() if n.endswith("linear_attn.conv1d.weight")}
        layouts = {len(shape) == 3 and shape[-1] == 1 for shape in convs.values()}
        if len(layouts) > 1:
            raise CheckpointError(f"{self.directory}: conv1d weights mix the HF [C, 1, K] and MLX [C, K, 1] layouts")
        if layouts:
            return layouts.pop()
        return any(n.startswith("language_model.") for n in parts)

    def add_dense(self, canonical: str, part: _Part, sanitized: bool) -> None:
        if part.loc.dtype == "U32" and part.name.endswith(".weight"):
            scales = part.name[: -len(".weight")] + ".scales"
            raise CheckpointError(f"{self.where(part)}: packed U32 weight but missing tensor {scales!r}")
        fused = _FUSED_EXPERTS.match(canonical)
        per_expert = _PER_EXPERT.match(canonical)
        if fused:
            self.check_float(part)
            prefix, which = fused.groups()
            stored = part.loc.shape
            if which == "down_proj":
                target = f"{prefix}.switch_mlp.down_proj.weight"
                if target not in self.expected:
                    raise self.unexpected(part)
                self.check_shape(part, target, stored)
                self.add(target, _Dense(part, stored), part)
                return
            gate, up = f"{prefix}.switch_mlp.gate_proj.weight", f"{prefix}.switch_mlp.up_proj.weight"
            if gate not in self.expected:
                raise self.unexpected(part)
            e, inter, h = self.expected[gate]
            if stored != (e, 2 * inter, h):
                raise CheckpointError(
                    f"{self.where(part)}: wrong shape {list(stored)}; "
                    f"expected {[e, 2 * inter, h]} (fused gate|up experts)"
                )
            self.add(gate, _Dense(part, (e, inter, h), rows=slice(0, inter)), part)
            self.add(up, _Dense(part, (e, inter, h), rows=slice(inter, 2 * inter)), part)
            return
        if per_expert:
            self.check_float(part)
            prefix, expert, which = per_expert.groups()
            target = f"{prefix}.switch_mlp.{which}_proj.weight"
            if target not in self.expected or int(expert) >= self.expected[target][0]:
                raise self.unexpected(part)
            if part.loc.shape != self.expected[target][1:]:
                raise CheckpointError(
                    f"{self.where(part)}: wrong shape {list(part.loc.shape)}; "
                    f"expected {list(self.expected[target][1:])}"
                )
            self.per_expert.setdefault(target, {})[int(expert)] = part
            return
        if canonical not in self.expected:
            raise self.unexpected(part)
        self.check_float(part)
        stored = part.loc.shape
        shape = stored
        if canonical.endswith("conv1d.weight"):
            channels, kernel = self.expected[canonical]
            # HF stores [C, 1, K]; MLX [C, K, 1]; both hold the same bytes as [C, K].
            if stored not in ((channels, 1, kernel), (channels, kernel, 1), (channels, kernel)):
                raise CheckpointError(
                    f"{self.where(part)}: wrong shape {list(stored)}; expected [{channels}, 1, {kernel}] (HF) "
                    f"or [{channels}, {kernel}, 1] (MLX)"
                )
            shape = (channels, kernel)
        self.check_shape(part, canonical, shape, stored)
        add_one = not sanitized and bool(_SHIFTED_NORM.match(canonical))
        self.add(canonical, _Dense(part, shape, add_one=add_one), part)

    def finish_per_expert(self) -> None:
        for target, experts in self.per_expert.items():
            count = self.expected[target][0]
            missing = [e for e in range(count) if e not in experts]
            any_part = next(iter(experts.values()))
            if missing:
                prefix, which = target.rsplit(".switch_mlp.", 1)
                raise CheckpointError(
                    f"{self.directory}: missing tensor {prefix}.experts.{missing[0]}.{which!s} "
                    f"(per-expert layout; {len(missing)} of {count} experts missing)"
                )
            self.add(target, _Stacked(tuple(experts[e] for e in range(count)), self.expected[target]), any_part)

    def add_quantized(self, canonical: str, module: str, parts: dict[str, _Part]) -> None:
        weight, scales = parts[module + ".weight"], parts[module + ".scales"]
        biases = parts.get(module + ".biases")
        if biases is None:
            raise CheckpointError(
                f"{self.where(scales)}: affine quantization needs {module + '.biases'!r}, which is missing"
            )
        if canonical not in self.expected or not _is_quantizable(canonical, self.expected[canonical], 1):
            raise self.unexpected(weight)
        assert self.spec is not None
        override = self.spec.overrides.get(module)
        if override is False:
            raise CheckpointError(f"{self.where(scales)}: config.json says {module!r} is not quantized")
        bits = (override or {}).get("bits", self.spec.bits)
        group = (override or {}).get("group_size", self.spec.group_size)
        if weight.loc.dtype != "U32":
            raise CheckpointError(f"{self.where(weight)}: wrong dtype {weight.loc.dtype} (expected U32 packed weights)")
        for part in (scales, biases):
            self.check_float(part)
        expected = self.expected[canonical]
        packed = expected[:-1] + (expected[-1] * bits // 32,)
        grouped = expected[:-1] + (expected[-1] // group,)
        if expected[-1] % group:
            raise CheckpointError(
                f"{self.where(weight)}: input dim {expected[-1]} is not a multiple of group size {group}"
            )
        for part, want in ((weight, packed), (scales, grouped), (biases, grouped)):
            if part.loc.shape != want:
                raise CheckpointError(
                    f"{self.where(part)}: wrong shape {list(part.loc.shape)}; expected {list(want)} for "
                    f"{canonical!r} {list(expected)} at {bits} bits, group size {group}"
                )
        if scales.loc.dtype != biases.loc.dtype:
            raise CheckpointError(
                f"{self.where(biases)}: dtype {biases.loc.dtype} differs from its scales' {scales.loc.dtype}"
            )
        self.add(canonical, _Quantized(weight, scales, biases, bits, group, expected), weight)

    def quantize_on_load(self, name: str, source: _Source) -> _Source:
        group = 64
        if not isinstance(source, (_Dense, _Stacked)) or not _is_quantizable(name, source.shape, group):
            return source
        bits = 8 if _EIGHT_BIT.search(name) else self.quantize
        return _QuantizeOnLoad(source, bits, group)


def _generation_config(directory: Path) -> dict[str, Any]:
    path = directory / "generation_config.json"
    return read_json_object(path, CheckpointError) if path.is_file() else {}


def _with_generation_eos(args: ModelArgs, generation: Mapping[str, Any], directory: Path) -> ModelArgs:
    where = f"{directory / 'generation_config.json'}: eos_token_id"
    values = eos_id_list(generation.get("eos_token_id"), where, CheckpointError)
    if not values:
        return args
    merged = list(args.eos_token_ids) + [v for v in values if v not in args.eos_token_ids]
    return replace(args, eos_token_ids=tuple(merged))


def load_checkpoint(path: str | Path, *, quantize: int | None = None) -> Checkpoint:
    """Open a checkpoint directory (HF or MLX layout, sharded or not) without reading the weights.

    ``quantize=4`` (or 8) quantizes an unquantized checkpoint on access exactly as
    ``mlx_lm.convert(quantize=True, q_group_size=64)`` does (router and shared-expert gate at
    8 bits; conv, norms, A_log and dt_bias stay dense). Raises :class:`CheckpointError` (and
    :class:`lily.config.ConfigError` for an invalid config.json).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    if quantize is not None and quantize not in (4, 8):
        raise CheckpointError(f"quantize must be None, 4 or 8, got {quantize!r}")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: missing config.json")
    args = ModelArgs.from_file(config_path)
    generation = _generation_config(directory)
    args = _with_generation_eos(args, generation, directory)
    spec = _quant_spec(args.quantization, config_path)

    files, index_map = _tensor_files(directory)
    parts: dict[str, _Part] = {}
    for file_path in files:
        st = SafetensorsFile(file_path)
        for name in st.tensors:
            if name in parts:
                raise CheckpointError(
                    f"{file_path}: tensor {name!r} is also in {parts[name].file.path.name} (duplicate)"
                )
            if index_map is not None and index_map.get(name) != file_path.name:
                raise CheckpointError(
                    f"{directory / 'model.safetensors.index.json'}: does not list tensor {name!r} of {file_path.name}"
                )
            parts[name] = _Part(st, name)
    if index_map is not None:
        for name, shard in index_map.items():
            if name not in parts:
                raise CheckpointError(
                    f"{directory / shard}: missing tensor {name!r} (listed in model.safetensors.index.json)"
                )

    sources, layout = _Builder(directory, args, quantize, spec).build(parts)
    if quantize is not None:
        overrides = {
            f"language_model.model.{name[: -len('.weight')]}": {"group_size": 64, "bits": 8}
            for name, s in sources.items()
            if isinstance(s, _QuantizeOnLoad) and _EIGHT_BIT.search(name)
        }
        args = replace(args, quantization={"group_size": 64, "bits": quantize, "mode": "affine", **overrides})
    tokenizer_dir = (
        directory if any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else None
    )
    template = directory / "chat_template.jinja"
    return Checkpoint(
        path=directory,
        args=args,
        weights=Weights(sources),
        format=layout,
        files=tuple(files),
        tokenizer_dir=tokenizer_dir,
        chat_template_path=template if template.is_file() else None,
        generation_config=generation,
    )


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "SafetensorsFile",
    "TensorLocation",
    "Weights",
    "canonical_shapes",
    "load_checkpoint",
]
