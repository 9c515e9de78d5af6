"""The gated MLP of the rotary families: down(act(gate(x)) * up(x)) (SwiGLU with silu, GeGLU with Gemma's
tanh GELU). A decoder layer's dense MLP, and the shape of every expert of `moe.SparseMoeBlock`."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.config.quantization_config import QuantScheme
from jaxserve.models.common import ACTIVATIONS, dense


class GatedMLP(nn.Module):
    intermediate_size: int
    hidden_size: int
    hidden_act: str
    dtype: jnp.dtype
    quantization: QuantScheme | None = None

    @nn.compact
    def __call__(self, x):
        gate = dense(self.intermediate_size, "gate_proj", self.dtype, quantization=self.quantization)(x)
        up = dense(self.intermediate_size, "up_proj", self.dtype, quantization=self.quantization)(x)
        down = dense(self.hidden_size, "down_proj", self.dtype, quantization=self.quantization)
        return down(ACTIVATIONS[self.hidden_act](gate) * up)
