"""Gemma 2 and Gemma 3 (text) in Flax: the rotary decoder of `llama.py` with Gemma's differences.

- Norms scale by (1 + weight), and four per layer: before and after attention, before and after the MLP
  (the "after" norms apply to the sublayer's output before the residual add).
- Token embeddings are multiplied by sqrt(hidden_size) rounded to the weights' dtype, as transformers does.
- Config-driven, in `common` and `llama.py`: the GeGLU MLP (tanh GELU), the softmax scale
  1/sqrt(query_pre_attn_scalar), sliding-window layers per `layer_types` (Gemma 2: every other layer,
  Gemma 3: five of six) chosen inside the step, Gemma 3's q/k norms and its rotary base for sliding layers,
  and Gemma 2's attention and final-logit soft-capping.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxserve.models.llama import DecoderLayer, LlamaForCausalLM, layer_rotary
from jaxserve.models.norms import RMSNorm


class GemmaDecoderLayer(DecoderLayer):
    """One Gemma block: `llama.DecoderLayer`'s fields, carry and scanned input, Gemma's four norms."""

    @nn.compact
    def __call__(self, carry, layer, rotary, meta):
        cfg = self.config
        hidden, kv_pool = carry
        normed = self._norm("input_layernorm")(hidden)
        attn_out, kv_pool = self.attention()(normed, kv_pool, layer, meta, layer_rotary(cfg, layer, rotary))
        hidden = hidden + self._norm("post_attention_layernorm")(attn_out)
        mlp_out = self.feed_forward()(self._norm("pre_feedforward_layernorm")(hidden))
        hidden = hidden + self._norm("post_feedforward_layernorm")(mlp_out)
        return (hidden, kv_pool), None

    def _norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.config.rms_norm_eps, self.dtype, 1.0, name=name)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and 3: `LlamaForCausalLM` with Gemma's layer and scaled embeddings."""

    decoder_layer: ClassVar[type[nn.Module]] = GemmaDecoderLayer

    def embed(self, input_ids):
        normalizer = np.asarray(np.sqrt(self.config.hidden_size), dtype=jnp.dtype(self.dtype)).astype(np.float32)
        return self.embed_tokens(input_ids) * normalizer
