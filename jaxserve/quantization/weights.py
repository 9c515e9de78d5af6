"""Weight quantization: a loaded parameter tree with its dense layers' kernels in the scheme's stored type.

Place in the data flow: the model runner calls `quantize_params` on the loaders' tree before it places the
weights on the mesh, so a float copy of a quantized weight never reaches a device (the host holds one layer
stack at a time in float32 while it is quantized). Each quantized `Linear` keeps `kernel` ([..., in, out], int8
or float8) and gains `kernel_scale` ([..., out], float32): kernel * kernel_scale is the weight, each output
channel scaled so that its largest magnitude is the stored type's largest value. The sharding rules place
`kernel_scale` as they place a bias (`distributed.sharding.param_spec`).

Quantized: the attention projections and the dense MLPs (`QUANTIZED_LINEARS`), and the stacked routed experts
of mixture-of-experts blocks (`experts/gate_proj` [..., E, in, out] gains `experts/gate_proj_scale` [..., E, out];
weights only, see `models.moe`). Not quantized: embeddings, norms, the LM head, a MoE block's router and shared
expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig, QuantScheme, parse_quantization

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MOE_BLOCK_KEY = "experts"  # a module holding this key is a MoE block: only its experts are quantized


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
        return {**tree, MOE_BLOCK_KEY: _quantize_experts(tree[MOE_BLOCK_KEY], scheme)}
    out = {}
    for key, value in tree.items():
        if key in QUANTIZED_LINEARS and isinstance(value, dict) and "kernel" in value:
            kernel, scale = quantize_kernel(value["kernel"], scheme)
            out[key] = {**value, "kernel": kernel, "kernel_scale": scale}
        else:
            out[key] = _quantize_tree(value, scheme)
    return out


def _quantize_experts(experts: dict, scheme: QuantScheme) -> dict:
    """A MoE block's stacked experts ([..., E, in, out]): values and scales per expert and output channel."""
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


def dequantize_kernel(values: Any, scale: Any) -> Any:
    """The float32 weight a quantized kernel stands for (references and accuracy checks)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    return xp.asarray(values, dtype=np.float32) * scale[..., None, :]
