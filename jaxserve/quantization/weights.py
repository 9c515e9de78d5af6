"""Weight quantization: a loaded parameter tree with its dense layers' kernels in the scheme's stored type.

Place in the data flow: the model runner calls `quantize_params` on the loaders' tree before it places the
weights on the mesh, so a float copy of a quantized weight never reaches a device (the host holds one layer
stack at a time in float32 while it is quantized). Each quantized `Linear` keeps `kernel` ([..., in, out], int8
or float8) and gains `kernel_scale` ([..., out], float32): kernel * kernel_scale is the weight, each output
channel scaled so that its largest magnitude is the stored type's largest value. The sharding rules place
`kernel_scale` as they place a bias (`distributed.sharding.param_spec`).

A grouped scheme ("gguf": `QuantScheme.group_size`) keeps int8 `kernel` codes with `group_scale` and `group_offset`
([..., in / group, out], float32) instead: the weight is codes * scale + offset, one scale and offset per group of
inputs of an output channel, as GGUF's blocks store them (`weights.gguf_blocks` keeps a file's blocks; a float weight
is quantized to it here, asymmetric: a group's smallest and largest weights span the 256 codes).

Quantized: the attention projections and the dense MLPs (`QUANTIZED_LINEARS`), and the stacked routed experts
of mixture-of-experts blocks (`experts/gate_proj` [..., E, in, out] gains `experts/gate_proj_scale` [..., E, out];
weights only, per channel, see `models.moe`). Not quantized: embeddings, norms, the LM head, a MoE block's router
and shared expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.quantization_config import QuantScheme, parse_quantization

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MOE_BLOCK_KEY = "experts"  # a module holding this key is a MoE block: only its experts are quantized ...
LAYER_ATTENTION_KEY = "self_attn"  # ... unless it is a whole layer (Gemma 4 keeps its experts beside its attention)
GROUP_SCALE, GROUP_OFFSET = "group_scale", "group_offset"  # a grouped scheme's leaves beside `kernel`
INT8_CODES = 256


class QuantizedTensor(NamedTuple):
    """A quantized checkpoint tensor as a loader gives it, in Hugging Face orientation: values [out, in] in the
    stored type; scale f32[out] (per channel) or f32[out, in / group] with offset (grouped)."""

    values: Any
    scale: Any
    offset: Any = None


def apply_quantization(model_config: ModelConfig, params: dict, quantization: str | None) -> tuple[ModelConfig, dict]:
    """The model as `quantization` (an `EngineConfig.quantization` name; None: unchanged) serves it: its config
    carrying the scheme (the layers read it; compile caches key on it) and its quantized parameters.

    A checkpoint stored quantized (its config already carries the scheme, `weights.compressed_tensors`) is served
    as stored: `quantization` may be left out or name the same scheme, as vLLM checks; its parameters are quantized
    already (an abstract tree for compiling only is quantized here)."""
    scheme = parse_quantization(quantization)
    stored = model_config.quantization
    if stored is not None:
        if scheme is not None and scheme.name != stored.name:
            raise ValueError(f"quantization={quantization!r} was asked for a checkpoint stored as {stored.name!r} "
                             f"(its quantization_config): leave it out or give {stored.name!r}")
        if _has_scales(params):
            return model_config, params
        scheme = stored
    if scheme is None:
        return model_config, params
    return dataclasses.replace(model_config, quantization=scheme), quantize_params(params, scheme)


def _has_scales(tree: Any) -> bool:
    """Whether a parameter tree holds quantized kernels (their scales) already."""
    if not isinstance(tree, dict):
        return False
    return any(key.endswith("_scale") or _has_scales(value) for key, value in tree.items())


def quantize_params(params: dict, scheme: QuantScheme) -> dict:
    """``params`` with every quantized Linear's kernel stored in ``scheme``'s type and its scales beside it.
    Leaves may be numpy arrays (quantized on the host), jax Arrays (quantized where they are) or
    ShapeDtypeStructs (an abstract tree for compiling only)."""
    return _quantize_tree(params, scheme)


def _quantize_tree(tree: Any, scheme: QuantScheme) -> Any:
    if not isinstance(tree, dict):
        return tree
    if MOE_BLOCK_KEY in tree:
        tree = {**tree, MOE_BLOCK_KEY: _quantize_experts(tree[MOE_BLOCK_KEY], scheme)}
        if LAYER_ATTENTION_KEY not in tree:  # a MoE block (its router and shared expert stay in dtype)
            return tree
    out = {}
    for key, value in tree.items():
        if key == MOE_BLOCK_KEY:
            out[key] = value  # Gemma 4's experts, beside its layer's attention: quantized above
        elif key in QUANTIZED_LINEARS and isinstance(value, dict) and "kernel" in value and scheme.group_size:
            codes, scale, offset = quantize_groups(value["kernel"], scheme.group_size)
            out[key] = {**value, "kernel": codes, GROUP_SCALE: scale, GROUP_OFFSET: offset}
        elif key in QUANTIZED_LINEARS and isinstance(value, dict) and "kernel" in value:
            kernel, scale = quantize_kernel(value["kernel"], scheme)
            out[key] = {**value, "kernel": kernel, "kernel_scale": scale}
        else:
            out[key] = _quantize_tree(value, scheme)
    return out


def grouped_experts_refusal(name: str) -> str:
    """Why a grouped scheme (``name``) cannot serve a mixture-of-experts model (the loaders refuse with it too)."""
    return f"quantization={name!r} does not serve mixture-of-experts models yet; quantization='int8' does"


def _quantize_experts(experts: dict, scheme: QuantScheme) -> dict:
    """A MoE block's stacked experts ([..., E, in, out]): values and scales per expert and output channel."""
    if scheme.group_size:
        raise ValueError(grouped_experts_refusal(scheme.name))
    out = {}
    for name, weight in experts.items():
        out[name], out[f"{name}_scale"] = quantize_kernel(weight, scheme)
    return out


def quantize_kernel(kernel: Any, scheme: QuantScheme) -> tuple[Any, Any]:
    """(values, scales) of a kernel [..., in, out]: per output channel, scale = max |w| / the type's largest value
    (1 for an all-zero channel), values = w / scale rounded to the stored type (int8: to nearest, clipped)."""
    if isinstance(kernel, jax.ShapeDtypeStruct):
        scale_shape = kernel.shape[:-2] + kernel.shape[-1:]
        return (jax.ShapeDtypeStruct(kernel.shape, scheme.weight_jnp_dtype),
                jax.ShapeDtypeStruct(scale_shape, jnp.float32))
    xp = np if isinstance(kernel, np.ndarray) else jnp
    weight = xp.asarray(kernel, dtype=np.float32)
    absmax = xp.max(xp.abs(weight), axis=-2)
    scale = xp.where(absmax > 0, absmax / scheme.max_value, 1.0).astype(np.float32)
    scaled = weight / scale[..., None, :]
    if scheme.weight_dtype == "int8":
        values = xp.clip(xp.round(scaled), -scheme.max_value, scheme.max_value).astype(np.int8)
    else:
        values = scaled.astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def quantize_groups(kernel: Any, group_size: int) -> tuple[Any, Any, Any]:
    """(int8 codes [..., in, out], scale and offset [..., in / group_size, out]) of a float kernel: per group of
    ``group_size`` inputs of an output channel, scale = (largest - smallest) / 255 (1 where they are equal) and
    codes = round((w - smallest) / scale) - 128, so that codes * scale + offset (offset = smallest + 128 scale)
    is within half a scale of w."""
    *lead, inputs, outputs = kernel.shape
    if inputs % group_size:
        raise ValueError(f"a kernel of {inputs} inputs does not split into groups of {group_size}")
    group_shape = (*lead, inputs // group_size, outputs)
    if isinstance(kernel, jax.ShapeDtypeStruct):
        return (jax.ShapeDtypeStruct(kernel.shape, jnp.int8), jax.ShapeDtypeStruct(group_shape, jnp.float32),
                jax.ShapeDtypeStruct(group_shape, jnp.float32))
    xp = np if isinstance(kernel, np.ndarray) else jnp
    grouped = xp.asarray(kernel, dtype=np.float32).reshape(*lead, inputs // group_size, group_size, outputs)
    smallest, largest = xp.min(grouped, axis=-2), xp.max(grouped, axis=-2)
    scale = xp.where(largest > smallest, (largest - smallest) / (INT8_CODES - 1), 1.0).astype(np.float32)
    steps = xp.round((grouped - smallest[..., None, :]) / scale[..., None, :])
    codes = (xp.clip(steps, 0, INT8_CODES - 1) - INT8_CODES // 2).astype(np.int8).reshape(kernel.shape)
    offset = (smallest + (INT8_CODES // 2) * scale).astype(np.float32)
    return codes, scale, offset


def dequantize_groups(codes: Any, scale: Any, offset: Any) -> Any:
    """The float32 weight [..., in, out] of grouped codes: codes * scale + offset, group by group (inside the
    steps, `quantization.matmul`; and references)."""
    xp = np if isinstance(codes, np.ndarray) else jnp
    *lead, inputs, outputs = codes.shape
    groups = scale.shape[-2]
    grouped = xp.asarray(codes, dtype=np.float32).reshape(*lead, groups, inputs // groups, outputs)
    return (grouped * scale[..., None, :] + offset[..., None, :]).reshape(codes.shape)


def dequantize_kernel(values: Any, scale: Any) -> Any:
    """The float32 weight a quantized kernel stands for (references and accuracy checks)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    return xp.asarray(values, dtype=np.float32) * scale[..., None, :]
