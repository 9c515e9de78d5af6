"""The Llama-family decoder in Flax: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and SmolLM2 (tied embeddings).

Place in the data flow: the model runner calls `LlamaForCausalLM.apply` inside a jitted step with a
padded batch of token ids `[S, Q]`, the stacked KV pool and the step's `AttentionMetadata`; each layer
writes its new K/V into its slice of the pool and attends through the chosen attention backend. Layers
run under `nn.scan` over stacked weights, so compile time does not grow with depth.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionBackend, AttentionMetadata, token_positions, write_kv
from jaxserve.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """f32[head_dim // 2], computed as transformers does (including `llama3` and `linear` scaling)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotary_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[S, Q, head_dim] for the rotate-half convention."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [S, Q, H, D]; rotates pairs (i, i + D/2) as transformers' `rotate_half`."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight * normed.astype(self.dtype)


def _dense(features: int, name: str, dtype, use_bias: bool = False) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


class Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend

    @nn.compact
    def __call__(self, x, cos, sin, kv_pool, layer, meta: AttentionMetadata):
        cfg = self.config
        num_seqs, num_q = x.shape[:2]
        bias = cfg.attention_bias
        q = _dense(cfg.num_heads * cfg.head_dim, "q_proj", self.dtype, bias)(x)
        k = _dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", self.dtype, bias)(x)
        v = _dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", self.dtype, bias)(x)
        q = apply_rotary(q.reshape(num_seqs, num_q, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rotary(k.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim)
        k_pool, v_pool = write_kv(*kv_pool, layer, k, v, meta)
        out = self.backend.attend(
            q, k_pool, v_pool, layer, meta,
            sm_scale=1.0 / math.sqrt(cfg.head_dim), sliding_window=cfg.sliding_window,
        )
        out = out.reshape(num_seqs, num_q, cfg.num_heads * cfg.head_dim)
        return _dense(cfg.hidden_size, "o_proj", self.dtype)(out), (k_pool, v_pool)


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        gate = _dense(cfg.intermediate_size, "gate_proj", self.dtype)(x)
        up = _dense(cfg.intermediate_size, "up_proj", self.dtype)(x)
        return _dense(cfg.hidden_size, "down_proj", self.dtype)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One transformer block, scanned over layers: the carry is (hidden states, whole KV pool) and the
    scanned input is the layer number, so each layer writes and reads its pages of the pool in place."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend

    @nn.compact
    def __call__(self, carry, layer, rotary, meta):
        cfg = self.config
        hidden, kv_pool = carry
        cos, sin = rotary
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        attn_out, kv_pool = Attention(cfg, self.dtype, self.backend, name="self_attn")(
            normed, cos, sin, kv_pool, layer, meta
        )
        hidden = hidden + attn_out
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        hidden = hidden + MLP(cfg, self.dtype, name="mlp")(normed)
        return (hidden, kv_pool), None


class LlamaForCausalLM(nn.Module):
    """`__call__` returns (final hidden states [S, Q, H], updated (k_pool, v_pool)); `logits` maps
    hidden states to float32 vocabulary logits. Pools are `[num_layers, Hkv, num_blocks, block_size, D]`."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: AttentionBackend | None = None

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        scanned = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )
        self.layers = scanned(cfg, self.dtype, self.backend)
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, "lm_head", self.dtype)
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)

    def __call__(self, input_ids, kv_pool, meta: AttentionMetadata):
        positions = token_positions(meta.q_start, input_ids.shape[1])
        rotary = rotary_cos_sin(positions, self.inv_freq)
        hidden = self.embed_tokens(input_ids)
        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (hidden, kv_pool), _ = self.layers((hidden, kv_pool), layer_ids, rotary, meta)
        return self.norm(hidden), kv_pool

    def logits(self, hidden):
        if self.config.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)
