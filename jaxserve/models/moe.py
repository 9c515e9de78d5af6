"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral, and Qwen2-MoE's with its shared expert.

Place in the data flow: a MoE family's decoder layer calls `SparseMoeBlock` where a dense family calls
`GatedMLP`, on the normed hidden states after attention (f32[..., hidden]: the engine's `[S, Q, H]` or
`[1, T, H]`), and adds its float32 output to the residual stream. The weight loaders fill its parameters
(layout below); with tensor parallelism `jaxserve.distributed.sharding.param_spec` places them.

Semantics are transformers' (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`):
router logits `x @ router` (float32), softmax in float32, the top k experts (lowest index first among
ties), their weights optionally renormalised to sum 1; a token's output is the sum over its k experts of
weight * down(act(gate(x)) * up(x)). No capacity limit: no token is ever dropped. The T * k (token, expert)
assignments are sorted by expert, the three projections run as grouped matmuls over the sorted rows
(`jax.lax.ragged_dot`, one group per expert), and the rows are unsorted, weighted and summed per token.
Every shape is static (T * k rows whatever the routing), so one compiled step serves every routing
pattern. Rows never mix: a padding token, whatever its values (even inf or NaN), changes only its own row.

Expert parallelism (`mesh` given, axis "tp"): each device holds E / tp experts (the experts' weights are
sharded on their expert axis; E must divide by tp); the router is replicated. Inside one `shard_map`
every device routes all tokens (x is replicated), runs the grouped matmuls over the assignments to its own
experts (the other devices' rows sort after every group and are zeroed), and a psum over "tp" sums the
partial outputs: one all-reduce per block. Qwen2-MoE's shared expert is split like the dense MLP (gate and
up column-parallel, down row-parallel, so its intermediate size must divide by tp too), and its partial
product joins the same psum.

Parameters, stored in `dtype`; the names the loaders fill:
    router/kernel                               [hidden, E]     (a `common.Linear` kernel, no bias)
    experts/gate_proj, experts/up_proj          [E, hidden, I]
    experts/down_proj                           [E, I, hidden]
    experts/{gate_proj,up_proj,down_proj}_scale [E, I] / [E, hidden]   (quantized experts only, float32)
    shared_expert/{gate_proj,up_proj}/kernel    [hidden, Is]    (Qwen2-MoE; `GatedMLP`'s layout)
    shared_expert/down_proj/kernel              [Is, hidden]
    shared_expert_gate/kernel                   [hidden, 1]

Quantized weights (`jaxserve.quantization`): the routed experts' weights are stored in the scheme's type with a
scale per expert and output channel, weights only whatever the scheme (vLLM's `experts_int8`): each product
converts the expert's values to `dtype` and scales its float32 result. The router and the shared expert stay in
`dtype`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config.quantization_config import QuantScheme
from jaxserve.distributed.sharding import TP_AXIS, check_divisible
from jaxserve.models.common import ACTIVATIONS, matmul
from jaxserve.models.params import weight


class SharedExpertParams(NamedTuple):
    gate_proj: jax.Array  # [hidden, Is]
    up_proj: jax.Array  # [hidden, Is]
    down_proj: jax.Array  # [Is, hidden]
    gate: jax.Array  # [hidden, 1]: the shared expert's output is scaled by sigmoid(x @ gate)


class ExpertScales(NamedTuple):
    """Quantized experts' scales, per expert and output channel (float32)."""

    gate_proj: jax.Array  # [E, I]
    up_proj: jax.Array  # [E, I]
    down_proj: jax.Array  # [E, hidden]


class ExpertBiases(NamedTuple):
    """gpt-oss's experts' biases, per expert and output channel."""

    gate_proj: jax.Array  # [E, I]
    up_proj: jax.Array  # [E, I]
    down_proj: jax.Array  # [E, hidden]


class MoeParams(NamedTuple):
    router: jax.Array  # [hidden, E]
    gate_proj: jax.Array  # [E, hidden, I]
    up_proj: jax.Array  # [E, hidden, I]
    down_proj: jax.Array  # [E, I, hidden]
    shared: SharedExpertParams | None
    scales: ExpertScales | None = None  # the experts' scales when they are quantized
    router_bias: jax.Array | None = None  # [E] (gpt-oss)
    biases: ExpertBiases | None = None  # the experts' biases (gpt-oss)


# How each device holds the parameters inside the shard_map (the layout `sharding.param_spec` gives them).
EXPERT_PARALLEL_SPECS = MoeParams(P(), P(TP_AXIS, None, None), P(TP_AXIS, None, None), P(TP_AXIS, None, None), None)
EXPERT_SCALE_SPECS = ExpertScales(P(TP_AXIS, None), P(TP_AXIS, None), P(TP_AXIS, None))
EXPERT_BIAS_SPECS = ExpertBiases(P(TP_AXIS, None), P(TP_AXIS, None), P(TP_AXIS, None))
SHARED_EXPERT_SPECS = SharedExpertParams(P(None, TP_AXIS), P(None, TP_AXIS), P(TP_AXIS, None), P())


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's k experts, best first, and their weights: (f32[T, k], i32[T, k])."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def sort_by_expert(experts: jax.Array, first_expert: jax.Array | int, num_local: int):
    """The flattened assignments `experts` i32[T, k] ordered by expert, the experts `first_expert ..
    first_expert + num_local - 1` first and all others after them: (order i32[T*k], group_sizes
    i32[num_local], is_local bool[T*k] in the original order)."""
    local = experts.reshape(-1) - first_expert
    is_local = (local >= 0) & (local < num_local)
    key = jnp.where(is_local, local, num_local)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    return order, group_sizes, is_local


def inverse_permutation(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, scale: jax.Array | None = None,
                   dtype: jnp.dtype | None = None, bias: jax.Array | None = None) -> jax.Array:
    """Consecutive runs of x's rows (`group_sizes[g]` rows each) times their group's `w[g]` ([G, in, out]);
    rows after the last group give 0 (plus the last group's bias: callers drop them). The precision policy of
    `common.matmul`: x in the compute ``dtype`` (default w's), float32 out. Quantized ``w``: its values converted
    to ``dtype``, each row's result times its group's ``scale[g]`` ([G, out]); then its group's ``bias[g]``."""
    dtype = w.dtype if dtype is None else dtype
    out = jax.lax.ragged_dot(x.astype(dtype), w.astype(dtype), group_sizes, preferred_element_type=jnp.float32)
    if scale is None and bias is None:
        return out
    group_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
    group_of_row = jnp.minimum(group_of_row, w.shape[0] - 1)
    if scale is not None:
        out = out * scale[group_of_row]
    return out if bias is None else out + bias[group_of_row].astype(jnp.float32)


def grouped_gated_mlp(rows: jax.Array, params: MoeParams, group_sizes: jax.Array, glu, dtype=None) -> jax.Array:
    """down(glu(gate(x), up(x))) of each group of rows through its expert: f32[rows, hidden]."""
    scales = params.scales or ExpertScales(None, None, None)
    biases = params.biases or ExpertBiases(None, None, None)
    gate = grouped_matmul(rows, params.gate_proj, group_sizes, scales.gate_proj, dtype, biases.gate_proj)
    up = grouped_matmul(rows, params.up_proj, group_sizes, scales.up_proj, dtype, biases.up_proj)
    return grouped_matmul(glu(gate, up), params.down_proj, group_sizes, scales.down_proj, dtype, biases.down_proj)


def gated_activation(act: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The experts' act(gate) * up (Mixtral, Qwen-MoE)."""
    return lambda gate, up: act(gate) * up


def clamped_swiglu(alpha: float, limit: float) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """gpt-oss's experts: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    def glu(gate, up):
        gate = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1.0) * gate * jax.nn.sigmoid(alpha * gate)

    return glu


def routed_experts(
    x: jax.Array,  # f32[T, hidden]
    weights: jax.Array,  # f32[T, k]
    experts: jax.Array,  # i32[T, k]
    params: MoeParams,  # the experts first_expert, first_expert + 1, ... (all of them without a mesh)
    first_expert: jax.Array | int,
    glu: Callable[[jax.Array, jax.Array], jax.Array],  # (gate, up) -> the experts' hidden activations
    dtype: jnp.dtype | None = None,  # the products' input dtype (default: the experts' stored dtype)
) -> jax.Array:
    """f32[T, hidden]: each token's weighted sum over those of its k experts that `params` holds. With no
    more assignments than experts (decode at small batches) each assignment's expert weights are gathered
    (only the routed experts are read); otherwise one grouped matmul over the assignments sorted by expert."""
    num_tokens, top_k = experts.shape
    if num_tokens * top_k <= params.gate_proj.shape[0]:
        return gathered_experts(x, weights, experts, params, first_expert, glu, dtype)
    order, group_sizes, is_local = sort_by_expert(experts, first_expert, params.gate_proj.shape[0])
    out = grouped_gated_mlp(x[order // top_k], params, group_sizes, glu, dtype)[inverse_permutation(order)]
    out = jnp.where(is_local[:, None], out * weights.reshape(-1, 1), 0.0)
    return out.reshape(num_tokens, top_k, -1).sum(axis=1)


def gathered_experts(x, weights, experts, params: MoeParams, first_expert, glu, dtype=None) -> jax.Array:
    """`routed_experts` by gathering each (token, expert) assignment's weights: f32[T, hidden]. XLA:CPU runs
    `ragged_dot` as a masked product over every expert, which at a decode step multiplies E / k times the
    weights a token needs; this reads the k routed experts only."""
    num_local = params.gate_proj.shape[0]
    local = experts - first_expert
    is_local = (local >= 0) & (local < num_local)
    index = jnp.clip(local, 0, num_local - 1)  # [T, k]
    dtype = params.gate_proj.dtype if dtype is None else dtype
    scales = params.scales or ExpertScales(None, None, None)
    biases = params.biases or ExpertBiases(None, None, None)

    def product(spec, lhs, w, scale, bias):
        out = jnp.einsum(spec, lhs, w[index].astype(dtype), preferred_element_type=jnp.float32)
        out = out if scale is None else out * scale[index]
        return out if bias is None else out + bias[index].astype(jnp.float32)

    rows = x.astype(dtype)
    gate = product("th,tkhi->tki", rows, params.gate_proj, scales.gate_proj, biases.gate_proj)
    up = product("th,tkhi->tki", rows, params.up_proj, scales.up_proj, biases.up_proj)
    hidden = glu(gate, up).astype(dtype)
    out = product("tki,tkih->tkh", hidden, params.down_proj, scales.down_proj, biases.down_proj)
    return jnp.sum(jnp.where(is_local[..., None], out * weights[..., None], 0.0), axis=1)


def shared_expert(x: jax.Array, params: SharedExpertParams, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Qwen2-MoE's dense gated expert, scaled by sigmoid(x @ gate); a partial sum when its weights are a
    column- (gate, up) and row-parallel (down) slice."""
    hidden = act(matmul(x, params.gate_proj)) * matmul(x, params.up_proj)
    return jax.nn.sigmoid(matmul(x, params.gate)) * matmul(hidden, params.down_proj)


def moe_forward(
    x: jax.Array, params: MoeParams, *, top_k: int, norm_topk_prob: bool, act, glu=None,
    first_expert: jax.Array | int = 0, dtype: jnp.dtype | None = None,
) -> jax.Array:
    """The block on f32[T, hidden] with the experts (and shared-expert slice) that `params` holds; ``glu``: the
    experts' (gate, up) -> hidden (default act(gate) * up); ``dtype``: the experts' products' input dtype (default:
    their stored dtype; the model's dtype when they are quantized)."""
    logits = matmul(x, params.router)
    if params.router_bias is not None:
        logits = logits + params.router_bias.astype(jnp.float32)
    weights, experts = route(logits, top_k, norm_topk_prob)
    out = routed_experts(x, weights, experts, params, first_expert, glu or gated_activation(act), dtype)
    if params.shared is not None:
        out = out + shared_expert(x, params.shared, act)
    return out


def expert_parallel_forward(x: jax.Array, params: MoeParams, mesh: Mesh, **kwargs) -> jax.Array:
    """`moe_forward` with the experts sharded over the mesh: every device computes its experts' share of
    every token (and its slice of the shared expert), one psum adds them up."""

    def local(x, params):
        first_expert = jax.lax.axis_index(TP_AXIS) * params.gate_proj.shape[0]
        return jax.lax.psum(moe_forward(x, params, first_expert=first_expert, **kwargs), TP_AXIS)

    specs = EXPERT_PARALLEL_SPECS._replace(shared=None if params.shared is None else SHARED_EXPERT_SPECS,
                                           scales=None if params.scales is None else EXPERT_SCALE_SPECS,
                                           router_bias=None if params.router_bias is None else P(),
                                           biases=None if params.biases is None else EXPERT_BIAS_SPECS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs), out_specs=P())(x, params)


class Kernel(nn.Module):
    """A `common.Linear` kernel `[in, out]` (same name, initializer and dtype) returned as the array, for
    products computed inside the block's shard_map."""

    shape: tuple[int, int]
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return weight(self, "kernel", nn.initializers.lecun_normal(), self.shape, self.param_dtype)


class Router(nn.Module):
    """The router's `Kernel` [hidden, E] and, with ``bias`` (gpt-oss), its bias [E]: (kernel, bias or None)."""

    shape: tuple[int, int]
    param_dtype: jnp.dtype
    bias: bool = False

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        kernel = weight(self, "kernel", nn.initializers.lecun_normal(), self.shape, self.param_dtype)
        bias = weight(self, "bias", nn.initializers.zeros, self.shape[1:], self.param_dtype) if self.bias else None
        return kernel, bias


class ExpertWeights(nn.Module):
    """The routed experts' stacked weights (module "experts"): gate_proj and up_proj [E, hidden, I],
    down_proj [E, I, hidden]; quantized, in the scheme's type with their scales ([E, I], [E, hidden]); with
    ``bias`` (gpt-oss) {gate_proj,up_proj}_bias [E, I] and down_proj_bias [E, hidden] beside them."""

    num_experts: int
    intermediate_size: int
    dtype: jnp.dtype
    quantization: QuantScheme | None = None
    bias: bool = False

    @nn.compact
    def __call__(self, hidden_size: int) -> tuple[tuple[jax.Array, jax.Array, jax.Array], ExpertScales | None,
                                                  ExpertBiases | None]:
        into = (self.num_experts, hidden_size, self.intermediate_size)
        out_of = (self.num_experts, self.intermediate_size, hidden_size)
        names_and_shapes = (("gate_proj", into), ("up_proj", into), ("down_proj", out_of))
        biases = None
        if self.bias:
            biases = ExpertBiases(*(weight(self, f"{name}_bias", nn.initializers.zeros, shape[:1] + shape[2:],
                                           self.dtype) for name, shape in names_and_shapes))
        if self.quantization is None:
            init = nn.initializers.lecun_normal(batch_axis=0)
            return tuple(weight(self, name, init, shape, self.dtype) for name, shape in names_and_shapes), None, biases
        dtype = self.quantization.weight_jnp_dtype
        values = tuple(weight(self, name, nn.initializers.zeros, shape, dtype) for name, shape in names_and_shapes)
        scales = ExpertScales(*(weight(self, f"{name}_scale", nn.initializers.ones, shape[:1] + shape[2:], jnp.float32)
                                for name, shape in names_and_shapes))
        return values, scales, biases


class SharedExpertWeights(nn.Module):
    """Qwen2-MoE's shared expert (module "shared_expert"): `GatedMLP`'s gate_proj/up_proj/down_proj kernels."""

    intermediate_size: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, hidden_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        into, out_of = (hidden_size, self.intermediate_size), (self.intermediate_size, hidden_size)
        return (
            Kernel(into, self.dtype, name="gate_proj")(),
            Kernel(into, self.dtype, name="up_proj")(),
            Kernel(out_of, self.dtype, name="down_proj")(),
        )


class SparseMoeBlock(nn.Module):
    """The sparse MoE MLP: f32[..., hidden] -> f32[..., hidden], any leading shape (module docstring)."""

    num_experts: int
    num_experts_per_tok: int  # top k
    intermediate_size: int  # per expert (HF moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k weights to sum 1 (Mixtral: always)
    hidden_act: str  # a key of common.ACTIVATIONS
    dtype: jnp.dtype  # parameter dtype
    mesh: Mesh | None = None
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's shared expert, None without one
    quantization: QuantScheme | None = None  # the routed experts' weights quantized (weights only)
    bias: bool = False  # gpt-oss: the router and the experts have biases
    swiglu: tuple[float, float] | None = None  # gpt-oss: the experts' clamped SwiGLU (alpha, limit)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden_size = x.shape[-1]
        params = self._params(hidden_size)
        tokens = x.reshape(-1, hidden_size).astype(jnp.float32)
        glu = None if self.swiglu is None else clamped_swiglu(*self.swiglu)
        routing = dict(top_k=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob, dtype=self.dtype, glu=glu)
        act = ACTIVATIONS[self.hidden_act]
        if self.mesh is None:
            out = moe_forward(tokens, params, act=act, **routing)
        else:
            self._check_mesh()
            out = expert_parallel_forward(tokens, params, self.mesh, act=act, **routing)
        return out.reshape(x.shape)

    def _params(self, hidden_size: int) -> MoeParams:
        router, router_bias = Router((hidden_size, self.num_experts), self.dtype, self.bias, name="router")()
        experts, scales, biases = ExpertWeights(self.num_experts, self.intermediate_size, self.dtype,
                                                self.quantization, self.bias, name="experts")(hidden_size)
        shared = None
        if self.shared_expert_intermediate_size is not None:
            mlp = SharedExpertWeights(self.shared_expert_intermediate_size, self.dtype, name="shared_expert")
            gate = Kernel((hidden_size, 1), self.dtype, name="shared_expert_gate")()
            shared = SharedExpertParams(*mlp(hidden_size), gate)
        return MoeParams(router, *experts, shared, scales, router_bias, biases)

    def _check_mesh(self) -> None:
        sizes = {"num_experts": self.num_experts}
        if self.shared_expert_intermediate_size is not None:
            sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        check_divisible(sizes, self.mesh.shape[TP_AXIS])
