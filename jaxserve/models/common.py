"""Building blocks every model family shares: dense layers, activations, paged self-attention and the
layer scan.

Place in the data flow: a family's decoder layer (llama.py, opt.py) projects q/k/v and hands them to
`Attention`, which writes k/v into the layer's pages of the pool (`write_kv`) and attends through the
attention backend. With tensor parallelism (`mesh` given) the weights arrive sharded over heads, and the
pool write and attention run per device on that device's heads (`shard_map`): no head ever leaves its
device, only the row-parallel output projection sums across devices.

Parameter names are the same in every family (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj)
so that one rule table (`jaxserve.parallel`) shards them all.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.attention import AttentionBackend, AttentionMetadata, write_kv
from jaxserve.config import ModelConfig
from jaxserve.models.rotary import apply_rotary
from jaxserve.parallel import TP_AXIS

ACTIVATIONS = {
    "silu": nn.silu,
    "relu": nn.relu,
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
}


def dense(features: int, name: str, dtype, use_bias: bool = False) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


def paged_attention(
    q: jax.Array,  # [S, Q, Hq, D]
    k: jax.Array,  # [S, Q, Hkv, D]
    v: jax.Array,  # [S, Q, Hkv, D]
    kv_pool: tuple[jax.Array, jax.Array],  # each [L, Hkv, num_blocks, block_size, D]
    layer: jax.Array,  # i32[]
    meta: AttentionMetadata,
    backend: AttentionBackend,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Writes the step's k/v into the pool and attends; returns ([S, Q, Hq * D], updated pool).

    With a mesh, every device runs this on its own slice of the heads (q/k/v on axis 2, the pool on axis
    1): contiguous head slices keep each query head with its kv head, since Hq / tp = (Hq / Hkv) * Hkv / tp.
    """

    def local(q, k, v, k_pool, v_pool, layer, meta):
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, meta)
        out = backend.attend(q, k_pool, v_pool, layer, meta, sm_scale=sm_scale, sliding_window=sliding_window)
        return out, k_pool, v_pool

    if mesh is not None:
        heads, pool = P(None, None, TP_AXIS, None), P(None, TP_AXIS)
        local = jax.shard_map(
            local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P(), P()),
            out_specs=(heads, pool, pool), check_vma=False,
        )
    out, k_pool, v_pool = local(q, k, v, *kv_pool, layer, meta)
    num_seqs, num_q = q.shape[:2]
    return out.reshape(num_seqs, num_q, -1), (k_pool, v_pool)


class Attention(nn.Module):
    """Self-attention over the paged pool. `rotary` is (cos, sin) for rotary families, None for learned
    positions; `out_bias` says whether o_proj has a bias (OPT and GPT-2 do, the Llama family does not)."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None
    out_bias: bool = False

    @nn.compact
    def __call__(self, x, kv_pool, layer, meta: AttentionMetadata, rotary=None):
        cfg = self.config
        num_seqs, num_q = x.shape[:2]
        bias = cfg.attention_bias
        q = dense(cfg.num_heads * cfg.head_dim, "q_proj", self.dtype, bias)(x)
        k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", self.dtype, bias)(x)
        v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", self.dtype, bias)(x)
        q = q.reshape(num_seqs, num_q, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cfg.scale_attn_by_inverse_layer_idx:  # GPT-2 option: scores of layer i divided by i + 1
            q = q / (layer + 1).astype(q.dtype)
        out, kv_pool = paged_attention(
            q, k, v, kv_pool, layer, meta, self.backend,
            sm_scale=1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attn_weights else 1.0,
            sliding_window=cfg.sliding_window, mesh=self.mesh,
        )
        return dense(cfg.hidden_size, "o_proj", self.dtype, self.out_bias)(out), kv_pool


def scan_layers(layer_cls: type[nn.Module], num_layers: int, num_broadcast_inputs: int, *args, **kwargs):
    """`layer_cls(*args)` repeated `num_layers` times under `nn.scan` over stacked weights: the scanned
    input is the layer number, the carry is (hidden, kv pool), and the remaining inputs are broadcast."""
    scanned = nn.scan(
        layer_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0,) + (nn.broadcast,) * num_broadcast_inputs,
        length=num_layers,
    )
    return scanned(*args, **kwargs)
