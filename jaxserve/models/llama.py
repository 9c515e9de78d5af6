"""The Llama-family decoder in Flax: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and SmolLM2 (tied embeddings).

Place in the data flow: the model runner calls `LlamaForCausalLM.apply` inside a jitted step with a
batch of token ids (`[S, Q]` padded or `[1, T]` ragged), the stacked KV pool and the step's
`AttentionMetadata`; each layer writes its new K/V into its slice of the pool and attends through the chosen
attention backend
(`common.Attention`). Layers run under `nn.scan` over stacked weights, so compile time does not grow with
depth, or unrolled (`scan_layers=False`, on CPU; see `common.layer_stack`). Weights are stored in `dtype`;
activations are float32 between bf16-or-f32 matmuls (the precision policy of `common`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.metadata import AttentionMetadata, token_layout
from jaxserve.config import ModelConfig
from jaxserve.models.common import ACTIVATIONS, Attention, dense, embedding, layer_stack
from jaxserve.models.rotary import rope_inv_freq, rotary_cos_sin


class RMSNorm(nn.Module):
    """RMSNorm in float32 (weight stored in `dtype`); returns float32."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight.astype(jnp.float32) * normed


class GatedMLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        gate = dense(cfg.intermediate_size, "gate_proj", self.dtype)(x)
        up = dense(cfg.intermediate_size, "up_proj", self.dtype)(x)
        return dense(cfg.hidden_size, "down_proj", self.dtype)(ACTIVATIONS[cfg.hidden_act](gate) * up)


class DecoderLayer(nn.Module):
    """One transformer block, scanned over layers: the carry is (hidden states, whole KV pool) and the
    scanned input is the layer number, so each layer writes and reads its pages of the pool in place."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, carry, layer, rotary, meta):
        cfg = self.config
        hidden, kv_pool = carry
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        attn = Attention(cfg, self.dtype, self.backend, self.mesh, name="self_attn")
        attn_out, kv_pool = attn(normed, kv_pool, layer, meta, rotary)
        hidden = hidden + attn_out
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        hidden = hidden + GatedMLP(cfg, self.dtype, name="mlp")(normed)
        return (hidden, kv_pool), None


class LlamaForCausalLM(nn.Module):
    """`__call__` returns (final hidden states [S, Q, H], updated (k_pool, v_pool)); `logits` maps
    hidden states to float32 vocabulary logits. Pools are `[num_layers, Hkv, num_blocks, block_size, D]`."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: AttentionBackend | None = None
    mesh: Mesh | None = None
    scan_layers: bool = True
    untie_lm_head: bool = False  # a tied model's head as its own [hidden, vocab] kernel (common.untie_lm_head)

    def setup(self):
        cfg = self.config
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, self.dtype)
        self.layers = layer_stack(
            DecoderLayer, cfg.num_layers, 2, cfg, self.dtype, self.backend, self.mesh, scan=self.scan_layers
        )
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings or self.untie_lm_head:
            self.lm_head = dense(cfg.vocab_size, "lm_head", self.dtype)
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    def __call__(self, input_ids, kv_pool, meta: AttentionMetadata):
        positions = token_layout(meta, input_ids.shape).positions
        rotary = rotary_cos_sin(positions, self.inv_freq)
        hidden = self.embed_tokens(input_ids)
        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (hidden, kv_pool), _ = self.layers((hidden, kv_pool), layer_ids, rotary, meta)
        return self.norm(hidden), kv_pool

    def logits(self, hidden):
        if self.config.tie_word_embeddings and not self.untie_lm_head:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)
