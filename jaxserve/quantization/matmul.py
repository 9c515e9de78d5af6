"""The quantized products of a dense layer: float activations times a quantized kernel, float32 out.

Place in the data flow: `models.common.Linear` calls `quantized_matmul` instead of `matmul` when its kernel
was quantized (`quantization.weights`), inside the bucketed, AOT-compiled steps; `matmul` (the float product
under the precision policy) is passed in by the caller.

- Weights only ("int8", "fp8" without float8 hardware): x in the model's dtype times the stored values
  converted to it, float32 accumulation, then the per-channel scales on the float32 result. Scaling the result
  instead of the weight (qwix dequantizes the weight first) keeps one rounding fewer and leaves XLA a plain
  convert to fuse into the product: no dequantized weight is materialized as a stored array.
- Weights and activations ("int8_w8a8", "fp8" on float8 hardware): each token's row is quantized on the fly
  (its own scale, absmax: `quantize_rows`), and qwix's `dot_general` multiplies the two quantized operands in
  their type (int8 x int8 accumulating in int32; float8 x float8 in float32) and applies both scales to the
  result.
- Grouped weights ("gguf"), a scale and an offset per group of inputs: a group's scale does not factor out of the
  whole product as a channel's does, and XLA does not fuse a rebuilt weight into the matrix unit's operand (on TPU
  it writes the rebuilt matrix to HBM and reads it back, measured deviceless: docs/benchmarks/quantization.md). So
  off CPU (`QuantScheme.group_products`) each group's product runs on its int8 codes converted in the product, as
  "int8" does, and the scales weigh the per-group results: x @ W = sum_g s_g (x_g @ c_g) + (sum x_g) @ o_g, the
  offsets' term a product of the inputs' group sums. On CPU, where XLA runs those many 32-deep products slowly,
  the weight is rebuilt in float32 (`weights.dequantize_groups`) and converted to the model's dtype: the values a
  float load of the GGUF file gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxserve.config.quantization_config import FP8_E4M3_MAX, INT8_MAX, QuantScheme
from jaxserve.quantization.weights import dequantize_groups

if TYPE_CHECKING:
    import qwix


def quantized_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, scheme: QuantScheme,
                     compute_dtype: jnp.dtype, matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """x [..., in] @ (values [in, out] * scale [out]) as float32 [..., out]."""
    if scheme.quantize_activations:
        return _w8a8_matmul(x, values, scale)
    return matmul(x, values.astype(compute_dtype)) * scale


def grouped_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, offset: jax.Array, scheme: QuantScheme,
                   compute_dtype: jnp.dtype, matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """x [..., in] @ (codes [in, out] * scale + offset, both [in / group, out]) as float32 [..., out]."""
    if not scheme.group_products:
        return matmul(x, dequantize_groups(codes, scale, offset).astype(compute_dtype))
    groups, (inputs, outputs) = scale.shape[0], codes.shape
    rows = x.reshape(-1, groups, inputs // groups).astype(compute_dtype)
    per_group = jnp.einsum("tgk,gko->tgo", rows, codes.reshape(groups, inputs // groups, outputs).astype(compute_dtype),
                           preferred_element_type=jnp.float32)
    out = jnp.einsum("tgo,go->to", per_group, scale) + jnp.sum(rows, axis=-1, dtype=jnp.float32) @ offset
    return out.reshape(*x.shape[:-1], outputs)


def _w8a8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    import qwix  # imported where used: it pulls in flax.nnx and optax, seconds of every start without quantization

    rows = quantize_rows(x.reshape(-1, x.shape[-1]), values.dtype)
    weight = qwix.QArray(values, scale.reshape(1, -1), qtype=values.dtype)
    out = qwix.dot_general(rows, weight, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], values.shape[-1])


def quantize_rows(rows: jax.Array, dtype: jnp.dtype) -> qwix.QArray:
    """Each row of f32[T, in] in ``dtype`` with its own scale, vLLM's dynamic per-token rule: scale = max |row| /
    the type's largest value (127 for int8, 448 for float8 e4m3; 1 for a zero row), values = row / scale (int8:
    rounded to nearest even). qwix's `quantize` maps the maximum to 127.5 instead, so the largest entry of
    every row sits on a rounding boundary (-127 or -128 by the last bit of its product)."""
    import qwix

    rows = rows.astype(jnp.float32)
    largest = INT8_MAX if dtype == jnp.int8 else FP8_E4M3_MAX
    absmax = jnp.max(jnp.abs(rows), axis=1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / largest, 1.0)
    scaled = rows / scale
    values = jnp.round(scaled).astype(dtype) if dtype == jnp.int8 else scaled.astype(dtype)
    return qwix.QArray(values, scale, qtype=dtype)
