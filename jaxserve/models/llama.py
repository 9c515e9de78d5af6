"""The rotary decoder in Flax: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms), SmolLM2 (tied embeddings),
Phi-3 (its fused projections split at load; partial rotary), and the mixture-of-experts Mixtral, Qwen2-MoE,
Qwen3-MoE and gpt-oss (attention sinks and biases; `moe.SparseMoeBlock` in place of the MLP), and Qwen3-Next /
Qwen3.5 with full-attention layers only ((1 + weight) norms, the gated attention of `common.Attention`, Qwen2-MoE's
shared expert). Gemma 2 and 3 extend it (`gemma.py`).

Place in the data flow: the model runner calls `LlamaForCausalLM.apply` inside a jitted step with a
batch of token ids (`[S, Q]` padded or `[1, T]` ragged), the stacked KV pool and the step's
`AttentionMetadata`; each layer writes its new K/V into its slice of the pool and attends through the chosen
attention backend (`common.Attention`). Layers run as a scan over stacked weights, so compile time does
not grow with depth, or unrolled (`scan_layers=False`, on CPU; see `common.layer_stack`). Weights are stored
in `dtype`; activations are float32 between bf16-or-f32 matmuls (the precision policy of `common`).
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.metadata import AttentionMetadata, token_layout
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.common import (
    Attention,
    dense,
    embedding,
    layer_numbers,
    layer_stack,
    norm_offset,
    vocabulary_logits,
)
from jaxserve.models.mlp import GatedMLP
from jaxserve.models.moe import SparseMoeBlock
from jaxserve.models.norms import RMSNorm
from jaxserve.models.rotary import rotary_cos_sin


def feed_forward(cfg: ModelConfig, dtype, mesh: Mesh | None, sparse: bool | None = None) -> nn.Module:
    """The layer's MLP: a sparse mixture of experts where `sparse` (None: in every layer of the MoE families),
    else the dense gated MLP."""
    if sparse is None:
        sparse = cfg.num_experts is not None
    if not sparse:
        return GatedMLP(cfg.intermediate_size, cfg.hidden_size, cfg.hidden_act, dtype, cfg.quantization, name="mlp")
    return SparseMoeBlock(
        cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.hidden_act,
        dtype, mesh, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        quantization=cfg.quantization, bias=cfg.expert_bias, swiglu=cfg.swiglu, name="mlp",
    )


def layer_rotary(cfg: ModelConfig, layer, rotary):
    """The (cos, sin) of `layer`: `rotary` is one pair, or (global pair, sliding-layer pair) for Gemma 3."""
    if cfg.local_rope is None:
        return rotary
    (cos, sin), (local_cos, local_sin) = rotary
    slides = jnp.asarray(cfg.sliding_layers)[layer]
    return jnp.where(slides, local_cos, cos), jnp.where(slides, local_sin, sin)


class DecoderLayer(nn.Module):
    """One transformer block, scanned over layers: the carry is (hidden states, whole KV pool) and the
    scanned input is the layer number, so each layer writes and reads its pages of the pool in place.
    `sparse`: this layer's MLP kind where layers differ (unrolled; see `feed_forward`)."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None
    sparse: bool | None = None

    @nn.compact
    def __call__(self, carry, layer, rotary, meta):
        cfg = self.config
        hidden, kv_pool = carry
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, norm_offset(cfg), name="input_layernorm")(hidden)
        attn_out, kv_pool = self.attention()(normed, kv_pool, layer, meta, layer_rotary(cfg, layer, rotary))
        hidden = hidden + attn_out
        normed = RMSNorm(cfg.rms_norm_eps, self.dtype, norm_offset(cfg), name="post_attention_layernorm")(hidden)
        hidden = hidden + self.feed_forward()(normed)
        return (hidden, kv_pool), None

    def attention(self) -> nn.Module:
        """The layer's self-attention (a family's layer may attend otherwise: DeepSeek's latent attention)."""
        return Attention(self.config, self.dtype, self.backend, self.mesh, name="self_attn")

    def feed_forward(self) -> nn.Module:
        return feed_forward(self.config, self.dtype, self.mesh, self.sparse)


class LlamaForCausalLM(nn.Module):
    """`__call__` returns (final hidden states [S, Q, H], updated (k_pool, v_pool)); `logits` maps
    hidden states to float32 vocabulary logits. Pools are `[num_layers, Hkv, num_blocks, block_size, D]`."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: AttentionBackend | None = None
    mesh: Mesh | None = None
    scan_layers: bool = True
    untie_lm_head: bool = False  # a tied model's head as its own [hidden, vocab] kernel (common.untie_lm_head)

    decoder_layer: ClassVar[type[nn.Module]] = DecoderLayer

    def setup(self):
        cfg = self.config
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, self.dtype)
        # layers with different MLPs cannot share one stack of weights: such a model's layers are unrolled
        per_layer = tuple({"sparse": sparse} for sparse in cfg.sparse_layers) if cfg.mixes_mlp_kinds else None
        self.layers = layer_stack(
            self.decoder_layer, cfg.num_layers, 2, cfg, self.dtype, self.backend, self.mesh,
            scan=self.scan_layers and per_layer is None, per_layer=per_layer,
        )
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, norm_offset(cfg))
        if not cfg.tie_word_embeddings or self.untie_lm_head:
            self.lm_head = dense(cfg.vocab_size, "lm_head", self.dtype)

    def __call__(self, input_ids, kv_pool, meta: AttentionMetadata):
        positions = token_layout(meta, input_ids.shape).positions
        hidden = self.embed(input_ids)
        layer_ids = layer_numbers(self.config.num_layers)
        (hidden, kv_pool), _ = self.layers((hidden, kv_pool), layer_ids, self.rotary(positions), meta)
        return self.norm(hidden), kv_pool

    def embed(self, input_ids):
        return self.embed_tokens(input_ids)

    def rotary(self, positions):
        """(cos, sin) of every token, or for Gemma 3 that pair and its sliding layers' (see `layer_rotary`)."""
        cfg = self.config
        rotary = rotary_cos_sin(positions, cfg.rope, cfg.rotary_dim)
        if cfg.local_rope is None:
            return rotary
        return rotary, rotary_cos_sin(positions, cfg.local_rope, cfg.rotary_dim)

    def logits(self, hidden):
        return vocabulary_logits(self, hidden)
