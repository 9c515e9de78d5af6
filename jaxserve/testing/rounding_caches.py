"""transformers' KV caches holding K/V as the engine's quantized KV pools return them (float8: saturated and rounded
to e4m3, with or without a checkpoint's K/V scales; int8: each token's row per kv head rounded to 255 levels of its
max): transformers' generate with one of these is the reference of a quantized KV cache (tests/quantization and
scripts/check_gpu_quantization.py). Imports torch (the `test` extra) and transformers as it loads."""

from __future__ import annotations

import torch
import transformers

from jaxserve.attention.kv_cache import FP8_KV_MAX


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x saturated to +-448 and rounded to float8 e4m3, as the float8 pool stores it."""
    return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """K/V [B, H, T, D] as the int8 pool returns them: each (token, head) row rounded to 255 levels of its max."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / torch.where(scale == 0, 1.0, scale)).clamp(-127, 127) * scale


class RoundingCache(transformers.DynamicCache):
    """transformers' cache holding K/V as a quantized pool returns them: every new key and value passed through
    `rounded` (a subclass's) as it is stored."""

    rounded = staticmethod(lambda x: x)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.rounded(key_states), self.rounded(value_states), layer_idx, *args, **kwargs)


class Fp8RoundingCache(RoundingCache):
    """The float8 pool: K/V saturated and rounded to e4m3."""

    rounded = staticmethod(fp8_rounded)


class Int8RoundingCache(RoundingCache):
    """The int8 pool: every new key and value row quantized to its own max."""

    rounded = staticmethod(int8_rounded)


# a checkpoint's calibrated K/V scales per layer, small enough that K / k_scale often saturates at +-448
KV_SCALES = [(0.004, 0.006), (0.003, 0.005)]


class ScaledFp8RoundingCache(transformers.DynamicCache):
    """transformers' cache holding K/V as a float8 pool with a checkpoint's scales does: K / k_scale rounded (and
    saturated), times k_scale as read; V alike."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_scale, v_scale = KV_SCALES[layer_idx]
        key_states, value_states = (fp8_rounded(x / scale) * scale
                                    for x, scale in ((key_states, k_scale), (value_states, v_scale)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
