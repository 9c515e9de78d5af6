"""Number formats for stored weights and the KV cache: the quantization schemes, the KV cache dtypes, and
whether a platform's matrix unit multiplies float8.

Place in the data flow: `EngineConfig` checks `quantization` and `kv_cache_dtype` against the choices here;
the weight loaders (`jaxserve.weights`) and `jaxserve.quantization` turn the name into a `QuantScheme`
(`parse_quantization`), adapted to the platform it runs on (`QuantScheme.for_platform`), and store it in
`ModelConfig.quantization`, which the models' dense layers read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Schemes (weights per output channel, symmetric, except "gguf"'s groups; activations, where quantized, per token at
# run time), applied by `jaxserve.quantization`:
# - "int8": int8 weights, activations in the model's dtype (W8A16); the weight is converted inside the product
#   and its scale applied to the float32 result.
# - "int8_w8a8": int8 weights and activations, an int8 x int8 product accumulating in int32, both scales applied
#   to the result (TPU v5e/v6e, GPUs, CPUs with VNNI or AMX-INT8 multiply int8 natively).
# - "fp8": float8 e4m3 weights; activations in float8 too where the matrix unit multiplies float8 (NVIDIA compute
#   capability 8.9 and later), elsewhere in the model's dtype as "int8" does (vLLM's "fp8" falls back the same way).
# - "gguf" (vLLM's name for serving a GGUF file's quantized weights): int8 codes with a scale and an offset per
#   GGUF_GROUP_SIZE inputs of each output channel, the file's Q8_0, Q4/Q5_0/_1 and Q4/Q5_K blocks exactly as stored
#   (`weights.gguf_blocks`); activations in the model's dtype, the products per group off CPU
#   (`QuantScheme.group_products`), the weight rebuilt inside the step on CPU.
QUANTIZATION_CHOICES = ("int8", "int8_w8a8", "fp8", "gguf")
GGUF_GROUP_SIZE = 32
# what the KV cache stores (vLLM's names): "auto" the model's dtype; "fp8" (= "fp8_e4m3") float8 e4m3, scale 1 (or a
# checkpoint's per layer); "int8" (= vLLM's "int8_per_token_head") int8 with a float32 scale per token and kv head
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "int8", "int8_per_token_head")
KV_SCALE_NAMES = ("k_scale", "v_scale")  # a layer's float8 K/V scales from a checkpoint (`self_attn.k_scale`)

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """`name` (one of QUANTIZATION_CHOICES), the stored weight type and whether activations are quantized too."""

    name: str
    weight_dtype: str  # "int8" or "float8_e4m3fn"
    quantize_activations: bool
    # None: one scale per output channel (symmetric); n: a scale and an offset per n inputs of an output channel
    group_size: int | None = None
    # grouped weights: each group's product on its int8 codes, scaled after (TPU, GPU: no rebuilt matrix in HBM),
    # or the weight rebuilt before one product (CPU, whose dot on groups of 32 is slow); set by `for_platform`
    group_products: bool = False

    @property
    def weight_jnp_dtype(self) -> Any:
        import jax.numpy as jnp  # configuration imports without jax

        return jnp.dtype(self.weight_dtype)

    @property
    def max_value(self) -> float:
        """The largest magnitude of the stored type: a channel's largest weight maps to it."""
        return INT8_MAX if self.weight_dtype == "int8" else FP8_E4M3_MAX

    def for_platform(self, platform: str, compute_capability: str | None = None) -> QuantScheme:
        """The scheme as it runs on ``platform`` ("cpu", "tpu", "cuda"/"gpu"): "fp8" quantizes activations only
        where the matrix unit takes float8 operands; a grouped scheme multiplies group by group off CPU."""
        if self.group_size:
            return dataclasses.replace(self, group_products=platform != "cpu")
        if self.name != "fp8":
            return self
        return dataclasses.replace(self, quantize_activations=has_fp8_matrix_unit(platform, compute_capability))


def has_fp8_matrix_unit(platform: str, compute_capability: str | None) -> bool:
    """NVIDIA GPUs of compute capability 8.9 (Ada) and later multiply float8 natively; TPUs before v7, and CPUs,
    do not."""
    if platform not in ("cuda", "gpu") or not compute_capability:
        return False
    major, _, minor = compute_capability.partition(".")
    return (int(major), int(minor or 0)) >= (8, 9)


def parse_quantization(name: str | None) -> QuantScheme | None:
    """The scheme `name` selects (None: no quantization); a ValueError naming the choices otherwise."""
    if name is None:
        return None
    if name == "int8":
        return QuantScheme("int8", "int8", quantize_activations=False)
    if name == "int8_w8a8":
        return QuantScheme("int8_w8a8", "int8", quantize_activations=True)
    if name == "fp8":
        return QuantScheme("fp8", "float8_e4m3fn", quantize_activations=True)
    if name == "gguf":
        return QuantScheme("gguf", "int8", quantize_activations=False, group_size=GGUF_GROUP_SIZE)
    raise ValueError(f"unsupported quantization {name!r}; supported: {', '.join(QUANTIZATION_CHOICES)}")
