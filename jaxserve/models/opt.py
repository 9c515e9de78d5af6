"""OPT in Flax (facebook/opt-*): learned absolute positions (table offset by 2), LayerNorm, ReLU MLP, biases
everywhere, pre-norm (125m and most sizes) or post-norm (350m) blocks, and optional projections between
a narrower word embedding and the hidden size (350m: 512 -> 1024).

Place in the data flow: the same interface and paged KV pool as the Llama family (see llama.py); layers
run as a scan over stacked weights (or unrolled, `scan_layers=False`) and attend through `common.Attention`. GPT-2
(gpt2.py) is this decoder with position offset 0. Parameter names follow this package's common names,
not Hugging Face's (fc1 -> up_proj, out_proj -> o_proj); `jaxserve.weights` converts.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.metadata import AttentionMetadata, token_layout
from jaxserve.config.model_config import ModelConfig
from jaxserve.models.common import ACTIVATIONS, Attention, dense, embedding, layer_numbers, layer_stack


def layer_norm(config: ModelConfig, dtype, name: str | None = None) -> nn.LayerNorm:
    affine = config.layer_norm_affine
    return nn.LayerNorm(  # float32 math and output; scale and bias stored in `dtype`
        epsilon=config.layer_norm_eps, dtype=jnp.float32, param_dtype=dtype, use_bias=affine, use_scale=affine,
        name=name,
    )


class MLP(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        up = dense(cfg.intermediate_size, "up_proj", self.dtype, cfg.mlp_bias, cfg.quantization)(x)
        down = dense(cfg.hidden_size, "down_proj", self.dtype, cfg.mlp_bias, cfg.quantization)
        return down(ACTIVATIONS[cfg.hidden_act](up))


class LayerNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)) (pre-norm); or norm(x + attn(x)), norm(x + mlp(x))."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, carry, layer, meta):
        cfg = self.config
        hidden, kv_pool = carry
        attn_norm = layer_norm(cfg, self.dtype, "attn_norm")
        mlp_norm = layer_norm(cfg, self.dtype, "mlp_norm")
        attn = Attention(cfg, self.dtype, self.backend, self.mesh, out_bias=cfg.attention_bias, name="self_attn")
        mlp = MLP(cfg, self.dtype, name="mlp")
        if cfg.pre_norm:
            attn_out, kv_pool = attn(attn_norm(hidden), kv_pool, layer, meta)
            hidden = hidden + attn_out
            hidden = hidden + mlp(mlp_norm(hidden))
        else:
            attn_out, kv_pool = attn(hidden, kv_pool, layer, meta)
            hidden = attn_norm(hidden + attn_out)
            hidden = mlp_norm(hidden + mlp(hidden))
        return (hidden, kv_pool), None


class OPTForCausalLM(nn.Module):
    """`__call__` returns (final hidden states [S, Q, E], updated pool) where E is the word-embedding width;
    `logits` maps them to float32 vocabulary logits (tied to the embeddings unless an lm_head exists)."""

    position_offset: ClassVar[int] = 2  # OPT's position table starts 2 rows in (a fairseq padding legacy)

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    backend: AttentionBackend | None = None
    mesh: Mesh | None = None
    scan_layers: bool = True
    untie_lm_head: bool = False  # a tied model's head as its own [hidden, vocab] kernel (common.untie_lm_head)

    def setup(self):
        cfg = self.config
        embed_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = embedding(cfg.vocab_size, embed_dim, self.dtype)
        num_positions = cfg.max_position_embeddings + self.position_offset
        self.embed_positions = embedding(num_positions, cfg.hidden_size, self.dtype)
        if cfg.word_embed_proj_dim is not None:
            self.project_in = dense(cfg.hidden_size, "project_in", self.dtype)
            self.project_out = dense(embed_dim, "project_out", self.dtype)
        self.layers = layer_stack(
            LayerNormDecoderLayer, cfg.num_layers, 1, cfg, self.dtype, self.backend, self.mesh, scan=self.scan_layers
        )
        if cfg.final_norm:
            self.norm = layer_norm(cfg, self.dtype)
        if not cfg.tie_word_embeddings or self.untie_lm_head:
            self.lm_head = dense(cfg.vocab_size, "lm_head", self.dtype)

    def __call__(self, input_ids, kv_pool, meta: AttentionMetadata):
        cfg = self.config
        # padding slots past the table read its last row: their outputs are discarded anyway
        positions = jnp.minimum(token_layout(meta, input_ids.shape).positions, cfg.max_position_embeddings - 1)
        hidden = self.embed_tokens(input_ids)
        if cfg.word_embed_proj_dim is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + self.position_offset)
        layer_ids = layer_numbers(cfg.num_layers)
        (hidden, kv_pool), _ = self.layers((hidden, kv_pool), layer_ids, meta)
        if cfg.final_norm:
            hidden = self.norm(hidden)
        if cfg.word_embed_proj_dim is not None:
            hidden = self.project_out(hidden)
        return hidden, kv_pool

    def logits(self, hidden):
        if self.config.tie_word_embeddings and not self.untie_lm_head:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)
