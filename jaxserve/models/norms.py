"""RMSNorm of the rotary families, in float32 whatever the weights' dtype.

Llama-style norms scale by `weight`; Gemma's by `1 + weight` (its checkpoints store the offset from one,
`offset=1.0`). Decoder layers normalise the residual stream with it, and Qwen3 and Gemma 3 each head of q and
k (`common.Attention`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.params import weight


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight) over the last axis; weight stored in `dtype`, float32 out."""

    eps: float
    dtype: jnp.dtype
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = weight(self, "weight", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) + self.offset) * normed
