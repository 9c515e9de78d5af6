"""DeepSeek-V2 / V3 and Kimi K2 in Flax: multi-head latent attention over a latent KV cache, DeepSeek's MoE routing.

Place in the data flow: as `llama.py`'s model (whose layer stack, embedding and head it reuses), the runner calls
`DeepseekForCausalLM.apply` in a jitted step with a batch of token ids, the KV pool and the step's
`AttentionMetadata`. The pool keeps one "kv head" per token and layer: the latent c (kv_lora_rank, after its norm)
and the rotary key k_pe (after rotary), [c | k_pe]; it has no V pages (`ModelConfig.kv_values_in_keys`).

Attention in decode and mixed steps, weight-absorbed (vLLM's MLA; `config/mla_config.py`): each head's position-free
query is projected into the latent space through its slice of kv_b_proj (q_lat = W_UK^T q_nope), so its scores
against a cached token are [q_lat | q_pe] . [c | k_pe]: multi-query attention of head dim kv_lora_rank +
qk_rope_head_dim over the latent pool, with the pool itself as the values (`AttentionBackend.attend_latent`: the
Pallas latent kernel on TPU and GPU, the CPU kernel, plain XLA); the first kv_lora_rank of each head's output are
sum_t p_t c_t, which the head's value slice (W_UV) takes out of the latent space before o_proj. Prefill steps attend
in the expanded form (`mla_expanded.py`: the context's latents expanded to per-head keys and values), the faster
for chunks of many tokens. On TPU the pool's rows are padded with zeros to whole 128-lane tiles.

transformers' DeepSeek, otherwise: q through a low-rank pair (q_a_proj, its norm, q_b_proj) or one q_proj (V2-Lite);
the latent norms' eps is 1e-6 whatever `rms_norm_eps` says; rotary on q_pe and k_pe only (the checkpoints' interleaved
pairs are permuted to rotate-half at load); softmax scale qk_head_dim^-0.5 * mscale^2. MoE layers after the first
`first_k_dense_replace`: V3's sigmoid scores with a correction bias for selection, top-2 sums per group of experts,
the best `topk_group` groups, top k, unbiased weights renormalised and scaled; V2's softmax, greedy or group-limited
(groups by their best expert); shared experts beside the routed ones.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.kv_cache import write_keys
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.config.mla_config import MLAConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.distributed.sharding import TP_AXIS
from jaxserve.models.common import ACTIVATIONS, dense, einsum_f32, matmul
from jaxserve.models.llama import DecoderLayer, LlamaForCausalLM
from jaxserve.models.mla_expanded import expanded_attention
from jaxserve.models.mlp import GatedMLP
from jaxserve.models.moe import (
    EXPERT_PARALLEL_SPECS,
    EXPERT_SCALE_SPECS,
    ExpertWeights,
    Kernel,
    MoeParams,
    gated_activation,
    routed_experts,
)
from jaxserve.models.norms import RMSNorm
from jaxserve.models.params import weight
from jaxserve.models.rotary import apply_rotary, rotary_cos_sin

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep their default eps


class MLAttention(nn.Module):
    """With a mesh, each device attends for its heads (q_b_proj and kv_b_proj split by head) over the whole latent
    pool, which every device writes alike."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x, kv_pool, layer, meta: AttentionMetadata, rotary):
        cfg, mla = self.config, self.config.mla
        num_seqs, num_q = x.shape[:2]
        heads, rank, nope = cfg.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim
        q = self._query(x).reshape(num_seqs, num_q, heads, mla.qk_head_dim)
        q_nope, q_pe = q[..., :nope], apply_rotary(q[..., nope:], *rotary)
        compressed = dense(mla.latent_dim, "kv_a_proj_with_mqa", self.dtype, cfg.attention_bias)(x)
        latent = RMSNorm(LATENT_NORM_EPS, self.dtype, name="kv_a_layernorm")(compressed[..., :rank])
        k_pe = apply_rotary(compressed[..., None, rank:], *rotary)  # one rotary key for every head
        w_kv = Kernel((rank, heads * (nope + mla.v_head_dim)), self.dtype, name="kv_b_proj")()
        w_kv = w_kv.reshape(rank, heads, nope + mla.v_head_dim)
        key = pad_to_row(jnp.concatenate([latent[..., None, :], k_pe], axis=-1), cfg.head_dim)  # [S, Q, 1, W]
        k_pool, v_pool = kv_pool
        if mla.prefill_form == "expanded" and num_q > 1 and not meta.is_ragged:  # a prefill step
            values, k_pool = expanded_prefill(q_nope, q_pe, w_kv, key, k_pool, layer, meta, mla, self.mesh)
        else:
            query = jnp.concatenate([einsum_f32("sqhd,rhd->sqhr", q_nope, w_kv[..., :nope]), q_pe], axis=-1)
            query = pad_to_row(query, cfg.head_dim)
            latent_out, k_pool = latent_attention(query, key, k_pool, layer, meta, self.backend, mla, self.mesh)
            values = einsum_f32("sqhr,rhv->sqhv", latent_out, w_kv[..., nope:])
        o_proj = dense(cfg.hidden_size, "o_proj", self.dtype, cfg.attention_bias, cfg.quantization)
        return o_proj(values.reshape(num_seqs, num_q, -1)), (k_pool, v_pool)

    def _query(self, x):
        cfg, mla = self.config, self.config.mla
        width = cfg.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            return dense(width, "q_proj", self.dtype, quantization=cfg.quantization)(x)
        low = dense(mla.q_lora_rank, "q_a_proj", self.dtype, cfg.attention_bias)(x)
        return dense(width, "q_b_proj", self.dtype)(RMSNorm(LATENT_NORM_EPS, self.dtype, name="q_a_layernorm")(low))


def pad_to_row(x: jax.Array, width: int) -> jax.Array:
    """[..., r + dr] padded with zeros to the pool's rows of ``width`` values (`mla_config.latent_row_width`): the
    zeros add nothing to a score."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


HEADS = P(None, None, TP_AXIS, None)  # [S, Q, H, ...] by head
KV_B_HEADS = P(None, TP_AXIS, None)  # kv_b_proj [r, H, nope + v] by head


def on_devices(local, mesh: Mesh | None, head_specs: tuple):
    """``local(*by_head, key, k_pool, layer, meta)`` -> (out [S, Q, H, ...], k_pool), on a mesh per device over its
    heads (the ``by_head`` arguments split as ``head_specs`` say), the pool whole on each, written alike."""
    if mesh is None:
        return local
    return jax.shard_map(local, mesh=mesh, in_specs=(*head_specs, P(), P(), P(), P()), out_specs=(HEADS, P()),
                         check_vma=False)


def latent_attention(query, key, k_pool, layer, meta: AttentionMetadata, backend: AttentionBackend, mla: MLAConfig,
                     mesh: Mesh | None):
    """(out [S, Q, H, r], pool): ``key`` [S, Q, 1, W] written into the latent pool, then multi-query attention of
    ``query`` [S, Q, H, W] over it, the rows' latents its values (`AttentionBackend.attend_latent`)."""

    def local(query, key, k_pool, layer, meta):
        k_pool = write_keys(k_pool, layer, key, meta)
        out = backend.attend_latent(query, k_pool, layer, meta, sm_scale=mla.softmax_scale,
                                    kv_lora_rank=mla.kv_lora_rank)
        return out, k_pool

    return on_devices(local, mesh, (HEADS,))(query, key, k_pool, layer, meta)


def expanded_prefill(q_nope, q_pe, w_kv, key, k_pool, layer, meta: AttentionMetadata, mla: MLAConfig,
                     mesh: Mesh | None):
    """(values f32[S, Q, H, v], pool): ``key`` [S, Q, 1, W] written into the latent pool, then the expanded form's
    attention of a prefill step (`mla_expanded.expanded_attention`)."""

    def local(q_nope, q_pe, w_kv, key, k_pool, layer, meta):
        k_pool = write_keys(k_pool, layer, key, meta)
        return expanded_attention(q_nope, q_pe, k_pool, layer, meta, w_kv, mla), k_pool

    return on_devices(local, mesh, (HEADS, HEADS, KV_B_HEADS))(q_nope, q_pe, w_kv, key, k_pool, layer, meta)


def deepseek_route(logits: jax.Array, correction: jax.Array | None, mla: MLAConfig, top_k: int,
                   norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32[T, k], experts i32[T, k]) of DeepSeek's routing (module docstring) from router logits f32[T, E]."""
    sigmoid = mla.routing == "noaux_tc"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores + correction if correction is not None else scores
    if mla.routing != "greedy" and mla.n_group > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.reshape(num_tokens, mla.n_group, num_experts // mla.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1) if sigmoid else grouped.max(-1)
        kept = jax.nn.one_hot(jax.lax.top_k(group_score, mla.topk_group)[1], mla.n_group).sum(1) > 0
        choice = jnp.where(kept[..., None], grouped, -jnp.inf if sigmoid else 0.0).reshape(num_tokens, num_experts)
    experts = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * mla.routed_scaling_factor, experts


def experts_of_tokens(tokens, weights, experts, params: MoeParams, glu, dtype, mesh: Mesh | None) -> jax.Array:
    """Each token's weighted sum over its routed experts; on a mesh each device runs its own experts (split whole
    over it) for every token and one psum adds them up (`moe.expert_parallel_forward`'s layout)."""
    if mesh is None:
        return routed_experts(tokens, weights, experts, params, 0, glu, dtype)

    def local(tokens, weights, experts, params):
        first_expert = jax.lax.axis_index(TP_AXIS) * params.gate_proj.shape[0]
        return jax.lax.psum(routed_experts(tokens, weights, experts, params, first_expert, glu, dtype), TP_AXIS)

    specs = EXPERT_PARALLEL_SPECS._replace(router=None, scales=None if params.scales is None else EXPERT_SCALE_SPECS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), specs), out_specs=P())(tokens, weights, experts,
                                                                                          params)


class DeepseekMoE(nn.Module):
    """The MoE MLP: routed experts (`moe.ExpertWeights`' layout, module "experts"), the router ("gate": its kernel
    and V3's correction bias) and the shared experts (one `GatedMLP` of n_shared_experts times the width)."""

    config: ModelConfig
    dtype: jnp.dtype
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x):
        cfg, mla = self.config, self.config.mla
        hidden = x.shape[-1]
        tokens = x.reshape(-1, hidden).astype(jnp.float32)
        kernel, correction = DeepseekGate(cfg.num_experts, self.dtype, mla.correction_bias, name="gate")(hidden)
        logits = matmul(tokens, kernel)
        weights, experts = deepseek_route(logits, correction, mla, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        (gate, up, down), scales, _ = ExpertWeights(cfg.num_experts, cfg.moe_intermediate_size, self.dtype,
                                                    cfg.quantization, name="experts")(hidden)
        glu = gated_activation(ACTIVATIONS[cfg.hidden_act])
        dtype = self.dtype if cfg.quantization is not None else None
        params = MoeParams(None, gate, up, down, None, scales)
        out = experts_of_tokens(tokens, weights, experts, params, glu, dtype, self.mesh)
        if mla.n_shared_experts:
            width = cfg.moe_intermediate_size * mla.n_shared_experts
            out = out + GatedMLP(width, hidden, cfg.hidden_act, self.dtype, name="shared_experts")(tokens)
        return out.reshape(x.shape)



class DeepseekGate(nn.Module):
    """The router: its kernel [hidden, E] and, with ``correction`` (V3), `e_score_correction_bias` [E] (float32)."""

    num_experts: int
    dtype: jnp.dtype
    correction: bool

    @nn.compact
    def __call__(self, hidden_size: int) -> tuple[jax.Array, jax.Array | None]:
        kernel = weight(self, "kernel", nn.initializers.lecun_normal(), (hidden_size, self.num_experts), self.dtype)
        if not self.correction:
            return kernel, None
        bias = weight(self, "e_score_correction_bias", nn.initializers.zeros, (self.num_experts,), self.dtype)
        return kernel, bias.astype(jnp.float32)


class DeepseekDecoderLayer(DecoderLayer):
    """`llama.DecoderLayer` with MLA and DeepSeek's MoE (or a dense MLP in the first layers)."""

    def attention(self) -> nn.Module:
        return MLAttention(self.config, self.dtype, self.backend, self.mesh, name="self_attn")

    def feed_forward(self) -> nn.Module:
        cfg = self.config
        sparse = cfg.num_experts is not None if self.sparse is None else self.sparse
        return DeepseekMoE(cfg, self.dtype, self.mesh, name="mlp") if sparse else super().feed_forward()


class DeepseekForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with DeepSeek's layer; the rotary embedding covers qk_rope_head_dim only."""

    decoder_layer: ClassVar[type[nn.Module]] = DeepseekDecoderLayer

    def rotary(self, positions):
        return rotary_cos_sin(positions, self.config.rope, self.config.mla.qk_rope_head_dim)
