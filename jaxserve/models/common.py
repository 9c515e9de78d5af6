"""Building blocks every model family shares: the precision policy's dense layers and embeddings,
activations, paged self-attention and the layer stack (scanned or unrolled).

Precision policy: parameters are stored in the model's `dtype` (float32 or bfloat16); every matmul takes
its inputs in that dtype and accumulates in float32 (`matmul`), and everything between the matmuls (the
residual stream, norms, rotary, softmax, logits) is float32. With float32 weights that is plain float32;
with bfloat16 weights the matmuls run on the matrix units (TPU MXU, GPU tensor cores, CPU AMX) and the
numerically delicate parts keep float32.

Place in the data flow: a family's decoder layer (llama.py, opt.py) projects q/k/v and hands them to
`Attention`, which writes k/v into the layer's pages of the pool (`write_kv`) and attends through the
attention backend. With tensor parallelism (`mesh` given) the weights arrive sharded over heads, and the
pool write and attention run per device on that device's heads (`shard_map`): no head ever leaves its
device, only the row-parallel output projection sums across devices.

Parameter names are the same in every family (q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj)
so that one rule table (`jaxserve.distributed.sharding`) shards them all.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.attention.backends import AttentionBackend
from jaxserve.attention.kv_cache import write_kv
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.config.model_config import GEMMA_FAMILIES, ModelConfig
from jaxserve.config.quantization_config import KV_SCALE_NAMES, QuantScheme
from jaxserve.config.qwen3_next_config import QWEN3_NEXT_FAMILIES
from jaxserve.distributed.sharding import TP_AXIS
from jaxserve.models.norms import RMSNorm
from jaxserve.models.params import weight
from jaxserve.models.rotary import apply_rotary
from jaxserve.quantization.matmul import grouped_matmul, quantized_matmul
from jaxserve.quantization.weights import GROUP_OFFSET, GROUP_SCALE

ACTIVATIONS = {
    "silu": nn.silu,
    "relu": nn.relu,
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
}


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w with x cast to w's dtype and float32 accumulation: float32 out, whatever the weights' dtype."""
    if w.dtype != jnp.float32 and math.prod(x.shape[:-1]) == 1:
        # one row: XLA:CPU has no bf16 matrix-vector product and would convert all of w to float32 first
        two_rows = jnp.broadcast_to(x.reshape(1, -1), (2, x.shape[-1]))
        return matmul(two_rows, w)[:1].reshape(*x.shape[:-1], w.shape[-1])
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def einsum_f32(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, y)`` with x cast to y's dtype and float32 accumulation (activations times weights under
    the precision policy, as `matmul`): float32 out."""
    return jnp.einsum(spec, x.astype(y.dtype), y, preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """A dense layer under the precision policy: `kernel [in, out]` (and `bias [out]`) stored in
    `param_dtype`, float32 output. Parameter names and initializers are `nn.Dense`'s. With a `quantization`
    scheme the kernel is stored in its type with `kernel_scale [out]` beside it, with a grouped one ("gguf") as int8
    codes with `group_scale` and `group_offset [in / group, out]` (`jaxserve.quantization`)."""

    features: int
    param_dtype: jnp.dtype
    use_bias: bool = False
    quantization: QuantScheme | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1], self.features)
        if self.quantization is None:
            y = matmul(x, weight(self, "kernel", nn.initializers.lecun_normal(), shape, self.param_dtype))
        elif self.quantization.group_size:
            y = self._grouped(x, shape)
        else:
            values = weight(self, "kernel", nn.initializers.zeros, shape, self.quantization.weight_jnp_dtype)
            scale = weight(self, "kernel_scale", nn.initializers.ones, (self.features,), jnp.float32)
            y = quantized_matmul(x, values, scale, self.quantization, self.param_dtype, matmul)
        if self.use_bias:
            y = y + weight(self, "bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(jnp.float32)
        return y

    def _grouped(self, x: jax.Array, shape: tuple[int, int]) -> jax.Array:
        """x times a grouped kernel: int8 codes with a scale and an offset per group of inputs (a GGUF's blocks)."""
        groups = (shape[0] // self.quantization.group_size, self.features)
        codes = weight(self, "kernel", nn.initializers.zeros, shape, jnp.int8)
        scale = weight(self, GROUP_SCALE, nn.initializers.ones, groups, jnp.float32)
        offset = weight(self, GROUP_OFFSET, nn.initializers.zeros, groups, jnp.float32)
        return grouped_matmul(x, codes, scale, offset, self.quantization, self.param_dtype, matmul)


def dense(features: int, name: str, dtype, use_bias: bool = False, quantization: QuantScheme | None = None) -> Linear:
    """A `Linear`; `quantization` only for the layers `jaxserve.quantization.weights` quantizes."""
    return Linear(features, dtype, use_bias, quantization, name=name)


class Embedding(nn.Embed):
    """`nn.Embed` under the precision policy: looks rows up in the stored dtype and returns them as float32
    (never converts the whole table), and `attend` (tied LM heads) is a `matmul` with float32 logits."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, inputs, axis=0).astype(jnp.float32)

    def attend(self, query: jax.Array) -> jax.Array:
        return matmul(query, self.embedding.T)


def embedding(num_embeddings: int, features: int, dtype, name: str | None = None) -> Embedding:
    return Embedding(num_embeddings, features, dtype=jnp.float32, param_dtype=dtype, name=name)


def paged_attention(
    q: jax.Array,  # [S, Q, Hq, D]
    k: jax.Array,  # [S, Q, Hkv, D]
    v: jax.Array,  # [S, Q, Hkv, D]
    kv_pool: tuple[jax.Array, jax.Array],  # each [layers_per_group, Hkv, num_blocks, block_size, D]
    layer: jax.Array,  # i32[], the layer's row of the pool (`kv_cache_place`)
    meta: AttentionMetadata,
    backend: AttentionBackend,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    slides: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Writes the step's k/v into the pool and attends; returns ([S, Q, Hq * D], updated pool).

    `sliding_window` applies to every layer when `slides` is None; otherwise `slides` (bool[], traced: the
    layer's entry of the model's per-layer pattern) says whether this layer uses it: the layer attends once,
    its window an operand of the attention (0: none), so a sliding layer reads only its window's pages.
    `sinks` (gpt-oss): the layer's logit per query head in each softmax's denominator.

    With a mesh, every device runs this on its own slice of the heads (q/k/v on axis 2, the pool on axis
    1): contiguous head slices keep each query head with its kv head, since Hq / tp = (Hq / Hkv) * Hkv / tp.
    """

    def local(q, k, v, k_pool, v_pool, layer, meta, slides, sinks):
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, meta, writes=backend.kv_writes)
        # the layer's window as an operand, not a lax.cond between two attentions: under one in the layer scan
        # XLA:CPU copies the whole pool every layer (Gemma 3 270M: a decode step 60x slower)
        window = sliding_window if slides is None else jnp.where(slides, sliding_window, 0)
        out = backend.attend(q, k_pool, v_pool, layer, meta, sm_scale=sm_scale, sliding_window=window,
                             logit_softcap=logit_softcap, sinks=sinks)
        return out, k_pool, v_pool

    if mesh is not None:
        heads, pool = P(None, None, TP_AXIS, None), P(None, TP_AXIS)
        local = jax.shard_map(
            local, mesh=mesh, in_specs=(heads, heads, heads, pool, pool, P(), P(), P(), P(TP_AXIS)),
            out_specs=(heads, pool, pool), check_vma=False,
        )
    out, k_pool, v_pool = local(q, k, v, *kv_pool, layer, meta, slides, sinks)
    num_seqs, num_q = q.shape[:2]
    return out.reshape(num_seqs, num_q, -1), (k_pool, v_pool)


def attention_scale(cfg: ModelConfig) -> float:
    """The softmax scale: 1/sqrt(head_dim), Gemma's 1/sqrt(query_pre_attn_scalar), 1 for unscaled GPT-2 and for
    Gemma 4 (whose q and k are normed per head)."""
    if cfg.family == "gemma4":
        return 1.0
    if cfg.mla is not None:
        return cfg.mla.softmax_scale
    if cfg.query_pre_attn_scalar is not None:
        return cfg.query_pre_attn_scalar**-0.5
    return 1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attn_weights else 1.0


def kv_cache_place(cfg: ModelConfig, layer) -> tuple:
    """(KV cache group, pool row) of `layer` (an int, or i32[] in the layers' scan): the layer itself in group 0
    when the model has one group, else looked up in its layout (`config/kv_cache_groups.py`)."""
    layout = cfg.kv_cache_layout
    if layout.num_groups == 1:
        return 0, layer
    if isinstance(layer, int):
        return layout.group_of[layer], layout.slot_of[layer]
    return jnp.asarray(layout.group_of, jnp.int32)[layer], jnp.asarray(layout.slot_of, jnp.int32)[layer]


def layer_window(cfg: ModelConfig, layer: jax.Array) -> tuple[int | None, jax.Array | None]:
    """(sliding_window, slides) for `paged_attention`: a static window when every layer is alike, else the
    window and whether `layer` uses it, looked up in the per-layer pattern inside the step."""
    pattern = cfg.sliding_layers
    if all(pattern) or not any(pattern):
        return (cfg.sliding_window if all(pattern) else None), None
    return cfg.sliding_window, jnp.asarray(pattern)[layer]


def norm_offset(cfg: ModelConfig) -> float:
    """Gemma's and Qwen3-Next's / Qwen3.5's norms scale by (1 + weight)."""
    return 1.0 if cfg.family in GEMMA_FAMILIES or cfg.family in QWEN3_NEXT_FAMILIES else 0.0


class Attention(nn.Module):
    """Self-attention over the paged pool. `rotary` is (cos, sin) for rotary families, None for learned
    positions; `out_bias` says whether o_proj has a bias (OPT and GPT-2 do; None: the config's
    `attention_out_bias`, the rotary families').
    Qwen3 and Gemma 3 normalise every head of q and k (`q_norm`, `k_norm`) before the rotary embedding.
    Qwen3-Next / Qwen3.5 (`attn_output_gate`): q_proj gives each head its query and then a gate (2 * head_dim rows
    per head), and the attention output is multiplied by sigmoid(gate) before o_proj.

    A checkpoint's float8 K/V scales (`k_scale`, `v_scale`: one per layer, `ModelConfig.kv_cache_scales`) are
    vLLM's: the pool stores K / k_scale and V / v_scale. One number per layer factors out of attention, so no
    backend reads them: q is multiplied by k_scale (q . K = (q k_scale) . K / k_scale) and the output by v_scale."""

    config: ModelConfig
    dtype: jnp.dtype
    backend: AttentionBackend
    mesh: Mesh | None = None
    out_bias: bool | None = None

    @nn.compact
    def __call__(self, x, kv_pool, layer, meta: AttentionMetadata, rotary=None):
        cfg = self.config
        q, k, v = self._project_qkv(x)
        gate = None
        if cfg.attn_output_gate:
            q, gate = q[..., :cfg.head_dim], q[..., cfg.head_dim:]
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, norm_offset(cfg), name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, norm_offset(cfg), name="k_norm")(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cfg.scale_attn_by_inverse_layer_idx:  # GPT-2 option: scores of layer i divided by i + 1
            q = q / (layer + 1).astype(q.dtype)
        if cfg.kv_cache_scales:
            k_scale, v_scale = (weight(self, name, nn.initializers.ones, (), jnp.float32) for name in KV_SCALE_NAMES)
            q, k, v = q * k_scale.astype(q.dtype), k / k_scale.astype(k.dtype), v / v_scale.astype(v.dtype)
        sliding_window, slides = layer_window(cfg, layer)
        sinks = None
        if cfg.attention_sinks:
            sinks = weight(self, "sinks", nn.initializers.zeros, (cfg.num_heads,), self.dtype).astype(jnp.float32)
        group, pool_row = kv_cache_place(cfg, layer)
        out, kv_pool = paged_attention(
            q, k, v, kv_pool, pool_row, meta.for_kv_group(group), self.backend, sm_scale=attention_scale(cfg),
            sliding_window=sliding_window, slides=slides, logit_softcap=cfg.attn_logit_softcap, sinks=sinks,
            mesh=self.mesh,
        )
        if cfg.kv_cache_scales:
            out = out * v_scale.astype(out.dtype)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.reshape(out.shape))
        out_bias = cfg.attention_out_bias if self.out_bias is None else self.out_bias
        return dense(cfg.hidden_size, "o_proj", self.dtype, out_bias, cfg.quantization)(out), kv_pool

    def _project_qkv(self, x):
        cfg = self.config
        num_seqs, num_q = x.shape[:2]
        bias = cfg.attention_bias
        quantization = cfg.quantization
        q_dim = 2 * cfg.head_dim if cfg.attn_output_gate else cfg.head_dim  # each head's query, then its gate
        q = dense(cfg.num_heads * q_dim, "q_proj", self.dtype, bias, quantization)(x)
        k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", self.dtype, bias, quantization)(x)
        v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", self.dtype, bias, quantization)(x)
        return (
            q.reshape(num_seqs, num_q, cfg.num_heads, q_dim),
            k.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(num_seqs, num_q, cfg.num_kv_heads, cfg.head_dim),
        )


def vocabulary_logits(model: nn.Module, hidden: jax.Array) -> jax.Array:
    """A causal LM's float32 logits of its final hidden states: through its embedding table where tied (and not
    untied for XLA:CPU, `untie_lm_head`), else its `lm_head`; soft-capped where its config says (Gemma)."""
    if model.config.tie_word_embeddings and not model.untie_lm_head:
        logits = model.embed_tokens.attend(hidden)
    else:
        logits = model.lm_head(hidden)
    cap = model.config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def layer_numbers(num_layers: int) -> np.ndarray:
    """The layers' numbers as a host array: constants of the step, so that layer i of an unrolled stack passes the
    literal i to its kernels (an iota sliced per layer is a compiled kernel per layer on XLA:CPU)."""
    return np.arange(num_layers, dtype=np.int32)


def layer_stack(layer_cls: type[nn.Module], num_layers: int, num_broadcast_inputs: int, *args, scan: bool,
                per_layer: tuple[dict, ...] | None = None) -> LayerStack:
    """`layer_cls(*args)` repeated `num_layers` times. Called as `stack((hidden, kv_pool), layer_ids,
    *broadcast_inputs)`; returns `((hidden, kv_pool), None)`. `per_layer`: keyword arguments of each layer
    where layers differ in structure (a model mixing dense and MoE MLPs), unrolled only.

    `scan=True`: one scan over stacked weights (`params["layers"]` with a leading layer axis), so
    compile time does not grow with depth (TPU, GPU). `scan=False`: one module per layer
    (`params["layers"]["0"]`, ...; `unstack_layers` converts), which XLA:CPU needs to run bf16 matmuls on
    its fast path (AMX or AVX512-BF16): inside a scan over stacked weights they lose it and run slower than
    float32 (shared/notes/cpu-bf16.md: 2-3x for the 30-layer embedded model)."""
    if scan and per_layer is not None:
        raise ValueError("layers that differ in structure cannot be scanned over one stack of weights")
    return LayerStack(layer_cls, num_layers, num_broadcast_inputs, args, scan, per_layer)


class LayerStack(nn.Module):
    """The layers, traced once: each layer kind's forward is one pure function of (its weights, carry, layer
    number, broadcast inputs), scanned over the stacked weights (`jax.lax.scan`) or, unrolled, called per
    layer as one `jax.jit` whose trace and lowering every layer shares (XLA inlines the calls, so the
    program is the one an unrolled trace gives). A 30-layer bfloat16 step traced each layer apart: 0.3 s of
    lowering of its 1.2 s compile; `nn.scan` traced its body twice. Initialization (shapes only, in
    precompile) builds the layers as modules, in the same parameter layout."""

    layer_cls: type[nn.Module]
    num_layers: int
    num_broadcast_inputs: int
    layer_args: tuple
    scan: bool
    per_layer: tuple[dict, ...] | None = None

    @nn.compact
    def __call__(self, carry, layer_ids, *broadcast_inputs):
        if self.is_initializing():
            layers = self._layer_modules()
            nn.share_scope(self, layers)
            return layers(carry, layer_ids, *broadcast_inputs)
        params = self.variables["params"]
        if self.scan:
            forward = self._layer_forward({})

            def body(carry, layer):
                layer_params, layer_id = layer
                return forward(layer_params, carry, layer_id, *broadcast_inputs)

            return jax.lax.scan(body, carry, (params, layer_ids))
        forwards = {}
        for i in range(self.num_layers):
            kwargs = self.per_layer[i] if self.per_layer is not None else {}
            key = tuple(sorted(kwargs.items()))
            if key not in forwards:
                forwards[key] = jax.jit(self._layer_forward(kwargs))
            carry, _ = forwards[key](params[str(i)], carry, layer_ids[i], *broadcast_inputs)
        return carry, None

    def _layer_forward(self, kwargs: dict):
        """One layer's forward as a pure function of its weights."""
        layer = self.layer_cls(*self.layer_args, **kwargs, parent=None)

        def decoder_layer(layer_params, carry, layer_id, *broadcast_inputs):
            return layer.apply({"params": layer_params}, carry, layer_id, *broadcast_inputs)

        return decoder_layer

    def _layer_modules(self) -> nn.Module:
        """The layers as modules (`nn.scan`, or one per layer), for initialization."""
        if self.scan:
            return nn.scan(
                self.layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0,) + (nn.broadcast,) * self.num_broadcast_inputs, length=self.num_layers,
            )(*self.layer_args)
        return UnrolledLayers(self.layer_cls, self.num_layers, self.layer_args, self.per_layer)


class UnrolledLayers(nn.Module):
    """The layers as separate modules named "0", "1", ..., called in order: how `LayerStack` initializes unrolled."""

    layer_cls: type[nn.Module]
    num_layers: int
    layer_args: tuple
    per_layer: tuple[dict, ...] | None = None

    @nn.compact
    def __call__(self, carry, layer_ids, *broadcast_inputs):
        for i in range(self.num_layers):
            kwargs = self.per_layer[i] if self.per_layer is not None else {}
            layer = self.layer_cls(*self.layer_args, **kwargs, name=str(i))
            carry, _ = layer(carry, layer_ids[i], *broadcast_inputs)
        return carry, None


def untie_lm_head(params: dict) -> dict:
    """A tied model's tree with its LM head as its own `[hidden, vocab]` kernel, the embedding table
    transposed (`params["params"]["lm_head"]["kernel"]`), for models built with `untie_lm_head=True`.
    XLA:CPU runs a bf16 matmul against the transposed table by converting the whole table to float32 first
    (113 MB per step for the embedded model, 74 ms vs 6 ms at 32 rows on 2 cores)."""

    def transposed(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[::-1], x.dtype)
        return x.T

    table = params["params"]["embed_tokens"]["embedding"]
    return {**params, "params": {**params["params"], "lm_head": {"kernel": transposed(table)}}}


def unstack_layers(params: dict, num_layers: int) -> dict:
    """The weight loaders' tree (`params["params"]["layers"]` stacked on a leading layer axis) as the
    unrolled stack's tree (`params["params"]["layers"][str(i)]`). Works on arrays and ShapeDtypeStructs.
    A tree already unrolled (the loaders' layout for models mixing dense and MoE layers) comes back as it is."""

    def layer_slice(x, i: int):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return x[i]

    stacked = params["params"]["layers"]
    if is_unrolled(stacked):
        return params
    layers = {str(i): jax.tree.map(lambda x, i=i: layer_slice(x, i), stacked) for i in range(num_layers)}
    return {**params, "params": {**params["params"], "layers": layers}}


def is_unrolled(layers: dict) -> bool:
    """Whether a `params["params"]["layers"]` tree holds one subtree per layer ("0", "1", ...)."""
    return "0" in layers
