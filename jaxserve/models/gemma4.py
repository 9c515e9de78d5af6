"""Gemma 4 (text) in Flax: Gemma 3's decoder with per-layer attention shapes, KV sharing, per-layer input
embeddings and a mixture of experts beside the dense MLP (`config/gemma4_config.py` lists what differs).

Place in the data flow: as `llama.py`'s model, the runner calls `Gemma4ForCausalLM.apply` in a jitted step with a
batch of token ids, the KV pool and the step's `AttentionMetadata`. Its full and sliding layers have pages of
different shapes, so the pool is one (K, V) pair per kind (`ModelConfig.kv_page_shapes`; one pair where the shapes
agree). Its layers differ in shape, so they are unrolled (`common.layer_stack`, one subtree of weights per layer),
whatever the platform.

transformers' `Gemma4ForCausalLM`, layer by layer:
- norms scale by `weight` (not Gemma 3's 1 + weight); q and k are normed per head with a weight, v without one;
  the softmax scale is 1; v is the k projection where `attention_k_eq_v` (full layers), never rotated;
- a KV-sharing layer projects only q and attends to the pages of the layer it shares with (written earlier in the
  same step), writing nothing;
- after attention: the dense MLP and, with a MoE block, the routed experts on the un-normed residual (router:
  RMSNorm without weight, times `scale` and hidden_size^-0.5, softmax, top k renormalised, times
  `per_expert_scale`), each normed before the two are added;
- per-layer inputs (PLE): each layer adds norm(proj(gelu(gate(h)) * ple_i)), ple_i its slice of the token's
  per-layer embedding mixed with a projection of its embedding; then the whole stream is scaled by `layer_scalar`;
- the full layers' "proportional" rotary embedding: the first `partial_rotary_factor` of each half of the head
  rotates at frequencies over the whole head dim, the rest passes (zero frequency).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.kv_cache import kind_pairs, pool_of_kinds
from jaxserve.attention.metadata import AttentionMetadata, token_layout
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.common import (
    ACTIVATIONS,
    dense,
    embedding,
    layer_numbers,
    layer_stack,
    paged_attention,
    vocabulary_logits,
)
from jaxserve.models.mlp import GatedMLP
from jaxserve.models.moe import ExpertWeights, MoeParams, gated_activation, routed_experts
from jaxserve.models.norms import RMSNorm
from jaxserve.models.params import weight
from jaxserve.models.rotary import apply_rotary, rotary_cos_sin


def scaled_by_dtype(value: float, dtype) -> np.float32:
    """``value`` rounded to the weights' dtype, as transformers scales Gemma's embeddings."""
    return np.asarray(value, dtype=jnp.dtype(dtype)).astype(np.float32)


def rms_without_weight(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def proportional_cos_sin(positions: jax.Array, head_dim: int, theta: float, partial: float, factor: float):
    """cos, sin f32[S, Q, head_dim] of the full layers' rotary embedding (module docstring)."""
    rotated = int(partial * head_dim // 2)
    inv_freq = np.zeros(head_dim // 2, np.float32)
    inv_freq[:rotated] = 1.0 / np.float32(theta) ** (np.arange(0, 2 * rotated, 2, dtype=np.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq / np.float32(factor))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Gemma4Attention(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    index: int  # the layer's number

    @nn.compact
    def __call__(self, x, kv_pool, meta: AttentionMetadata, rotary):
        cfg, i = self.config, self.index
        layers, layout = cfg.gemma4, cfg.kv_cache_layout
        head_dim, num_kv_heads = layers.head_dims[i], layers.kv_heads[i]
        num_seqs, num_q = x.shape[:2]
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, name=name)
        q = dense(cfg.num_heads * head_dim, "q_proj", self.dtype, quantization=cfg.quantization)(x)
        q = apply_rotary(norm("q_norm")(q.reshape(num_seqs, num_q, cfg.num_heads, head_dim)), *rotary)
        kind, num_kinds = layout.kind_of(i), layout.num_kinds
        pairs = kind_pairs(kv_pool, num_kinds)
        pool = pairs[kind]
        group_meta = meta.for_kv_group(layout.group_of[i])
        window = cfg.sliding_window if cfg.sliding_layers[i] else None
        if layers.kv_sources[i] == i:
            k, v = self._project_kv(x, head_dim, num_kv_heads, rotary)
            out, pool = paged_attention(q, k, v, pool, layout.slot_of[i], group_meta, self.backend, sm_scale=1.0,
                                        sliding_window=window)
            kv_pool = pool_of_kinds([pool if k == kind else pair for k, pair in enumerate(pairs)])
        else:  # KV sharing: the pages the source layer wrote, this step's tokens included
            out = self.backend.attend(q, *pool, layout.slot_of[i], group_meta, sm_scale=1.0, sliding_window=window,
                                      logit_softcap=None, sinks=None).reshape(num_seqs, num_q, -1)
        return dense(cfg.hidden_size, "o_proj", self.dtype, quantization=cfg.quantization)(out), kv_pool

    def _project_kv(self, x, head_dim: int, num_kv_heads: int, rotary):
        cfg = self.config
        shape = (*x.shape[:2], num_kv_heads, head_dim)
        k = dense(num_kv_heads * head_dim, "k_proj", self.dtype, quantization=cfg.quantization)(x).reshape(shape)
        if cfg.gemma4.k_eq_v[self.index]:
            v = k
        else:
            v = dense(num_kv_heads * head_dim, "v_proj", self.dtype, quantization=cfg.quantization)(x).reshape(shape)
        k = apply_rotary(RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k), *rotary)
        return k, rms_without_weight(v, cfg.rms_norm_eps)


class Gemma4Router(nn.Module):
    """(weights f32[T, k], experts i32[T, k]) of each token from the un-normed residual stream."""

    num_experts: int
    top_k: int
    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        hidden_size = x.shape[-1]
        scale = weight(self, "scale", nn.initializers.ones, (hidden_size,), self.dtype).astype(jnp.float32)
        per_expert = weight(self, "per_expert_scale", nn.initializers.ones, (self.num_experts,), self.dtype)
        z = rms_without_weight(x, self.eps) * scale * hidden_size**-0.5
        probs = jax.nn.softmax(dense(self.num_experts, "proj", self.dtype)(z), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * per_expert.astype(jnp.float32)[experts], experts


class Gemma4DecoderLayer(nn.Module):
    """One layer (unrolled: `index` is its number). Carry (hidden, KV pool); broadcast inputs the rotary pairs
    (sliding, full), the metadata and the per-layer inputs f32[S, Q, L, P] (None without PLE)."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None
    index: int = 0

    @nn.compact
    def __call__(self, carry, layer, rotary, meta, per_layer_inputs):
        cfg, i = self.config, self.index
        layers = cfg.gemma4
        hidden, kv_pool = carry
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, name=name)
        layer_rotary = rotary[0] if cfg.sliding_layers[i] else rotary[1]
        attn = Gemma4Attention(cfg, self.dtype, self.backend, i, name="self_attn")
        attn_out, kv_pool = attn(norm("input_layernorm")(hidden), kv_pool, meta, layer_rotary)
        residual = hidden + norm("post_attention_layernorm")(attn_out)
        mlp = GatedMLP(layers.intermediate_sizes[i], cfg.hidden_size, cfg.hidden_act, self.dtype, cfg.quantization,
                       name="mlp")(norm("pre_feedforward_layernorm")(residual))
        if layers.num_experts:
            mlp = norm("post_feedforward_layernorm_1")(mlp) + norm("post_feedforward_layernorm_2")(
                self._experts(residual))
        hidden = residual + norm("post_feedforward_layernorm")(mlp)
        if layers.per_layer_input_size:
            hidden = hidden + self._per_layer_input(hidden, per_layer_inputs[..., i, :])
        scalar = weight(self, "layer_scalar", nn.initializers.ones, (1,), self.dtype).astype(jnp.float32)
        return (hidden * scalar, kv_pool), None

    def _experts(self, residual):
        """The MoE block's parameters sit beside the layer's (`router/...`, `experts/...`), as in the checkpoints."""
        cfg, layers = self.config, self.config.gemma4
        tokens = residual.reshape(-1, residual.shape[-1]).astype(jnp.float32)
        weights, experts = Gemma4Router(layers.num_experts, layers.top_k_experts, cfg.rms_norm_eps, self.dtype,
                                        name="router")(tokens)
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name="pre_feedforward_layernorm_2")(tokens)
        (gate, up, down), scales, _ = ExpertWeights(layers.num_experts, layers.moe_intermediate_size, self.dtype,
                                                    cfg.quantization, name="experts")(tokens.shape[-1])
        glu = gated_activation(ACTIVATIONS[cfg.hidden_act])
        dtype = self.dtype if cfg.quantization is not None else None
        out = routed_experts(normed, weights, experts, MoeParams(None, gate, up, down, None, scales), 0, glu, dtype)
        return out.reshape(residual.shape)

    def _per_layer_input(self, hidden, per_layer_input):
        cfg = self.config
        gate = dense(cfg.gemma4.per_layer_input_size, "per_layer_input_gate", self.dtype)(hidden)
        projected = dense(cfg.hidden_size, "per_layer_projection", self.dtype)(
            ACTIVATIONS[cfg.hidden_act](gate) * per_layer_input)
        return RMSNorm(cfg.rms_norm_eps, self.dtype, name="post_per_layer_input_norm")(projected)


class Gemma4ForCausalLM(nn.Module):
    """`__call__` returns (final hidden states, updated pool); `logits` maps them to float32 vocabulary logits.
    `scan_layers` is accepted for the common constructor and ignored: the layers are always unrolled."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: AttentionBackend | None = None
    mesh: Mesh | None = None
    scan_layers: bool = False
    untie_lm_head: bool = False

    def setup(self):
        cfg = self.config
        layers = cfg.gemma4
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, self.dtype)
        if layers.per_layer_input_size:
            width = cfg.num_layers * layers.per_layer_input_size
            self.embed_tokens_per_layer = embedding(layers.vocab_size_per_layer_input, width, self.dtype)
            self.per_layer_model_projection = dense(width, "per_layer_model_projection", self.dtype)
            self.per_layer_projection_norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        per_layer = tuple({"index": i} for i in range(cfg.num_layers))
        self.layers = layer_stack(Gemma4DecoderLayer, cfg.num_layers, 3, cfg, self.dtype, self.backend, self.mesh,
                                  scan=False, per_layer=per_layer)
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
        if not cfg.tie_word_embeddings or self.untie_lm_head:
            self.lm_head = dense(cfg.vocab_size, "lm_head", self.dtype)

    def __call__(self, input_ids, kv_pool, meta: AttentionMetadata):
        cfg = self.config
        positions = token_layout(meta, input_ids.shape).positions
        hidden = self.embed_tokens(input_ids) * scaled_by_dtype(np.sqrt(cfg.hidden_size), self.dtype)
        per_layer_inputs = self._per_layer_inputs(input_ids, hidden) if cfg.gemma4.per_layer_input_size else None
        (hidden, kv_pool), _ = self.layers((hidden, kv_pool), layer_numbers(cfg.num_layers), self.rotary(positions),
                                           meta, per_layer_inputs)
        return self.norm(hidden), kv_pool

    def rotary(self, positions):
        """(sliding layers' cos/sin, full layers' cos/sin)."""
        cfg, layers = self.config, self.config.gemma4
        full_head_dim = next(layers.head_dims[i] for i, slides in enumerate(cfg.sliding_layers) if not slides)
        full = proportional_cos_sin(positions, full_head_dim, layers.full_rope_theta,
                                    layers.full_partial_rotary_factor, layers.full_rope_factor)
        if not any(cfg.sliding_layers):
            return full, full
        return rotary_cos_sin(positions, cfg.rope, cfg.head_dim), full

    def _per_layer_inputs(self, input_ids, embedded):
        """f32[S, Q, L, P]: each token's per-layer embedding mixed with a projection of its embedding."""
        cfg, width = self.config, self.config.gemma4.per_layer_input_size
        shape = (*input_ids.shape, cfg.num_layers, width)
        token = self.embed_tokens_per_layer(input_ids) * scaled_by_dtype(np.sqrt(width), self.dtype)
        context = self.per_layer_model_projection(embedded) * cfg.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + token.reshape(shape)) * 2**-0.5

    def logits(self, hidden):
        return vocabulary_logits(self, hidden)
