"""Checkpoints quantized in the compressed-tensors format (what llm-compressor writes and vLLM serves): the
`quantization_config` read as a jaxserve scheme, the quantized tensors read as stored, and a writer.

Place in the data flow: `read_hf_config` gives the model config the checkpoint's scheme (`checkpoint_scheme`), and
`params_from_hf` asks `CheckpointTensors` for each leaf: a quantized layer's kernel comes as its stored values
(int8 or float8 e4m3) with its `weight_scale` as `kernel_scale`, never widened to a float copy; a layer the model
keeps in float (the LM head, a MoE router or shared expert) comes as float, dequantized if the checkpoint quantized
it; a layer the scheme quantizes but the checkpoint left in float (its `ignore` list) is quantized as it loads.

Read (vLLM's CompressedTensorsW8A8Int8, W8A16 and W8A8Fp8 schemes): one config group targeting `Linear`, weights of
8 bits, symmetric, one scale per output channel or per tensor, static; input activations none or 8 bits, dynamic,
per token, of the weights' type. "int-quantized" with int8 activations is jaxserve's `int8_w8a8`, without them
`int8`; "float-quantized" (float8 e4m3 weights) is `fp8`, whose activations follow the platform as for online
quantization. Anything else is refused naming what is read. A `kv_cache_scheme` (float8, one static scale per
tensor: llm-compressor's calibrated `self_attn.k_scale` / `v_scale`, with or without quantized weights) gives the
model its K/V scales (`ModelConfig.kv_cache_scales`; they apply with `kv_cache_dtype="fp8"` as vLLM's do).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.config.quantization_config import KV_SCALE_NAMES, QuantScheme, parse_quantization
from jaxserve.quantization.weights import (
    GROUP_SCALE,
    QUANTIZED_LINEARS,
    QuantizedTensor,
    dequantize_kernel,
    quantize_kernel,
)
from jaxserve.weights.fp8_blocks import block_size as fp8_block_size
from jaxserve.weights.mxfp4 import QUANT_METHOD as MXFP4_METHOD

QUANT_METHOD = "compressed-tensors"
FORMATS = {"int-quantized": "int", "float-quantized": "float"}  # format -> the weights' number type
SCALE_SUFFIX = "_scale"  # `x.weight` -> `x.weight_scale`
# the kv_cache_scheme read: one static float8 scale per layer for K and one for V (`self_attn.k_scale`, `v_scale`)
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
SUPPORTED = ("int8 (W8A16) and int8 W8A8 per-token dynamic ('int-quantized'), float8 e4m3 weights with or without "
             "per-token dynamic float8 activations ('float-quantized'); symmetric, per channel or per tensor")


def checkpoint_scheme(hf_config: dict[str, Any]) -> QuantScheme | None:
    """The jaxserve scheme of a checkpoint's `quantization_config` (None: the checkpoint is not quantized); a
    ValueError naming what is supported for anything else."""
    config = hf_config.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method")
    if method == MXFP4_METHOD:  # gpt-oss's experts: dequantized at load (`mxfp4.py`), served as float weights
        return None
    if fp8_block_size(hf_config) is not None:  # DeepSeek's block-wise float8: dequantized at load (`fp8_blocks.py`)
        return None
    if method != QUANT_METHOD:
        raise ValueError(f"unsupported quantization_config quant_method {method!r}: jaxserve reads "
                         f"{QUANT_METHOD} checkpoints ({SUPPORTED})")
    groups = list((config.get("config_groups") or {}).values())
    if not groups and config.get("kv_cache_scheme") is not None:
        return None  # float weights, a float8 KV cache's scales only
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups: jaxserve reads one "
                         f"({SUPPORTED})")
    kind = FORMATS.get(config.get("format"))
    weights, activations = groups[0].get("weights") or {}, groups[0].get("input_activations")
    problem = _unsupported(kind, groups[0], weights, activations)
    if problem:
        raise ValueError(f"unsupported compressed-tensors scheme ({problem}); jaxserve reads {SUPPORTED}")
    if kind == "float":
        return parse_quantization("fp8")
    return parse_quantization("int8" if activations is None else "int8_w8a8")


def has_kv_cache_scales(hf_config: dict[str, Any]) -> bool:
    """Whether a checkpoint gives K and V a float8 scale per layer (its `kv_cache_scheme`: 8-bit float, one static
    scale per tensor, llm-compressor's calibrated `self_attn.k_scale` / `v_scale`); a ValueError for other schemes."""
    scheme = (hf_config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme is None:
        return False
    wrong = [f"{k}={scheme.get(k)!r}" for k, v in KV_CACHE_SCHEME.items() if scheme.get(k) != v]
    if wrong:
        raise ValueError(f"unsupported compressed-tensors kv_cache_scheme ({', '.join(wrong)}); jaxserve reads "
                         "float8 K/V scales per tensor (num_bits 8, type float, strategy tensor, static, symmetric)")
    return True


def _unsupported(kind: str | None, group: dict, weights: dict, activations: dict | None) -> str | None:
    """What about a config group jaxserve cannot serve as stored (None: nothing)."""
    if kind is None:
        return f"format must be one of {', '.join(FORMATS)}"
    if "Linear" not in (group.get("targets") or []):
        return "the group must target Linear"
    wanted = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False}
    wrong = [f"weights {k}={weights.get(k)!r}" for k, v in wanted.items() if weights.get(k) != v]
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("group_size") is not None:
        wrong.append(f"weights strategy={weights.get('strategy')!r}")
    if activations is not None:
        wanted = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": True, "strategy": "token"}
        wrong += [f"input_activations {k}={activations.get(k)!r}" for k, v in wanted.items()
                  if activations.get(k) != v]
    return ", ".join(wrong) or None


def is_quantized_leaf(path: tuple[str, ...]) -> bool:
    """Whether a parameter-tree leaf is a kernel the schemes quantize: the attention and dense MLP projections and
    a MoE block's stacked experts (not its router or shared expert; see `jaxserve.quantization.weights`)."""
    if "shared_expert" in path:
        return False
    return (path[-1] == "kernel" and path[-2] in QUANTIZED_LINEARS) or path[-2] == "experts"


def scale_path(path: tuple[str, ...], grouped: bool = False) -> tuple[str, ...]:
    """Where a quantized leaf's scales go: `kernel_scale` beside a kernel (`group_scale` for grouped codes),
    `<name>_scale` beside stacked experts."""
    if path[-1] == "kernel":
        return (*path[:-1], GROUP_SCALE if grouped else "kernel_scale")
    return (*path[:-1], path[-1] + SCALE_SUFFIX)


class CheckpointTensors:
    """A checkpoint's tensors by Hugging Face name, as float or as (stored values, per-channel scales)."""

    def __init__(self, get: Callable[[str], np.ndarray], has: Callable[[str], bool]):
        self.get, self.has = get, has

    def float(self, name: str) -> np.ndarray:
        """A tensor as float32: a quantized one ([out, in] with a `_scale`) dequantized."""
        value = np.asarray(self.get(name))
        if not _is_quantized_type(value.dtype):
            return value
        return dequantize_kernel(value.T, self._scale(name, value.shape[0])).T

    def quantized(self, name: str, scheme: QuantScheme) -> QuantizedTensor:
        """[out, in] values of the scheme's type with their f32[out] scales: as stored, or quantized now if the
        checkpoint kept this tensor in float (its ignore list)."""
        value = np.asarray(self.get(name))
        if not _is_quantized_type(value.dtype):
            values, scale = quantize_kernel(np.asarray(value, np.float32).T, scheme)
            return QuantizedTensor(values.T, scale)
        if value.dtype != np.dtype(scheme.weight_jnp_dtype):
            raise ValueError(f"{name} is stored as {value.dtype}, not the {scheme.weight_dtype} its "
                             "quantization_config says")
        return QuantizedTensor(value, self._scale(name, value.shape[0]))

    def _scale(self, name: str, out_features: int) -> np.ndarray:
        scale_name = name + SCALE_SUFFIX
        if not self.has(scale_name):
            raise ValueError(f"quantized tensor {name} has no {scale_name}")
        scale = np.asarray(self.get(scale_name), np.float32).reshape(-1)
        if scale.size not in (1, out_features):
            raise ValueError(f"{scale_name} has {scale.size} scales for {out_features} output channels")
        return np.broadcast_to(scale, (out_features,)).copy()


def _is_quantized_type(dtype: np.dtype) -> bool:
    return dtype in (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn))


# ----- writing (tests, and the checkpoints the benchmarks give vLLM) ------------------------------------------------

def quantization_config(scheme: QuantScheme) -> dict[str, Any]:
    """The `quantization_config` llm-compressor writes for `scheme` (per-channel weights; per-token dynamic
    activations where the scheme quantizes them; the LM head left out)."""
    kind = "int" if scheme.weight_dtype == "int8" else "float"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "observer": "minmax"}
    activations = None
    if scheme.quantize_activations or scheme.name == "fp8":
        activations = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True,
                       "observer": None}
    return {
        "quant_method": QUANT_METHOD, "format": f"{kind}-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"],
    }


def write_compressed_tensors(source: Path, out: Path, quantization: str) -> Path:
    """A float Hugging Face checkpoint directory `source` rewritten as a compressed-tensors one in `out`: every
    quantized linear's `weight` as int8 / float8 e4m3 [out, in] with `weight_scale` f32[out, 1] (per output
    channel, `jaxserve.quantization.weights.quantize_kernel`'s rule), every other tensor and file as it was."""
    from safetensors.numpy import load_file

    scheme = parse_quantization(quantization)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    written = {}
    for name, value in tensors.items():
        if _is_quantized_linear_name(name):
            values, scale = quantize_kernel(np.asarray(value, np.float32).T, scheme)
            written[name], written[name + SCALE_SUFFIX] = values.T, scale[:, None]
        else:
            written[name] = value
    _save_tensors(written, out / "model.safetensors")
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and "safetensors.index" not in file.name:
            shutil.copy(file, out / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_kv_cache_scales(model_dir: Path, scales: list[tuple[float, float]]) -> Path:
    """Gives the Hugging Face checkpoint in ``model_dir`` a float8 (k_scale, v_scale) per layer, as llm-compressor
    writes calibrated ones: `model.layers.{i}.self_attn.k_scale` / `v_scale` tensors and a `kv_cache_scheme` in its
    `quantization_config` (added to the one it has, or a new one for float weights). Rewrites the directory."""
    from safetensors.numpy import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"write_kv_cache_scales rewrites a one-file checkpoint; {model_dir} has {len(files)}")
    tensors = load_file(files[0])
    for layer, pair in enumerate(scales):
        for name, scale in zip(KV_SCALE_NAMES, pair, strict=True):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = np.float32([scale])
    _save_tensors(tensors, files[0])
    config = json.loads((model_dir / "config.json").read_text())
    quantization = config.get("quantization_config") or {"quant_method": QUANT_METHOD, "format": "dense",
                                                         "config_groups": {}}
    config["quantization_config"] = {**quantization, "kv_cache_scheme": dict(KV_CACHE_SCHEME)}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def _is_quantized_linear_name(name: str) -> bool:
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS
            and "shared_expert" not in parts)


def _save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """safetensors of numpy arrays, float8 and bfloat16 included (safetensors' numpy API takes neither: through
    torch, which does)."""
    import torch
    from safetensors.torch import save_file

    def as_torch(x: np.ndarray) -> torch.Tensor:
        if x.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        if x.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x))

    save_file({name: as_torch(x) for name, x in tensors.items()}, str(path))
