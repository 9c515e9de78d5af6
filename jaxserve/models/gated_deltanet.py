"""The gated DeltaNet linear attention of Qwen3-Next and Qwen3.5, as pure functions over bucketed rows.

Place in the data flow: a hybrid model's linear-attention layer (three in every four layers) will call these where
a full-attention layer reads and writes the paged KV pool. Instead of a growing cache, each sequence keeps a fixed
state per layer, gathered from and scattered back to a slot pool by the caller: the last K - 1 pre-conv inputs of
the causal conv (`conv_state [K-1, C]`, the model's dtype) and the delta rule's matrix per value head
(`state [nv, dk, dv]`, float32 whatever the model's dtype). Steps hand them rows as the engine's buckets do:
`[S, T, ...]`, S sequences of T slots each, the first `num_valid[s]` of row s real tokens and the rest padding
(any values, even inf or NaN: padding never reaches a state or a valid output). Prefill chunks run the chunkwise
form (`gated_delta_chunked`), decode rows one token each in the recurrent form (`gated_delta_step`); a chunk of a
prompt continues from the state its previous chunk left, so any split of a prompt into chunks is the same layer.

Semantics are transformers' torch fallback (`models/qwen3_next/modeling_qwen3_next.py`, 5.24:
`Qwen3NextGatedDeltaNet`, `causal_conv1d_update`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `Qwen3NextRMSNormGated`). Per token, in the Qwen3.5 weights' layout
(`qwen3next_to_qwen35_weights` permutes Qwen3-Next's fused projections into it at load time, exactly):

    mixed = x W_qkv = [q (nk dk) | k (nk dk) | v (nv dv)]      z = x W_z, b = x W_b, a = x W_a
    q, k, v = split(silu(depthwise causal conv of K taps over [conv_state ; mixed]))
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)                          (g <= 0: log decay)
    q, k = l2norm(q), l2norm(k) over dk (eps 1e-6), q *= dk^-0.5, both repeated to nv heads (v-head h: k-head h // r)
    per value head:  S <- S exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q          (S [dk, dv])
    out = (w_norm * o / rms(o) * silu(z)) W_out                                            (per head over dv)

The chunkwise form computes the same recurrence a chunk of C tokens at a time (the WY / UT transform of the
DeltaNet papers, transformers' algorithm): within a chunk, cumulative decays c = cumsum(g), a unit lower-triangular
solve (in matrix products: `unit_lower_inverse`) gives the chunk's corrections U and W, and one scan over chunks
carries S, so the T-step serial dependence becomes T / C steps of matrix products. Padding tokens are exact no-ops
(beta = 0 and g = 0 leave S bit for bit, their q, k, v zeroed), so a right-padded row ends with the state of its
valid tokens.

Every product of the recurrence runs at `Precision.HIGHEST`: the state accumulates over the whole sequence in
float32, and a TPU's default float32 precision would round each product's operands to bfloat16. The conv runs in
float32 over inputs rounded to the conv state's dtype (as transformers' conv sees the model's dtype), so a token's
conv is the same whether its predecessors come from the state or from the same chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.common import matmul

PRECISION = jax.lax.Precision.HIGHEST
CHUNK = 64  # tokens per chunk of the chunkwise form (transformers' and FLA's default)
L2NORM_EPS = 1e-6  # transformers' l2norm of q and k, whatever rms_norm_eps says
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default: x itself above it


class GatedDeltaNetDims(NamedTuple):
    """A layer's head counts and sizes (transformers' linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=PRECISION, preferred_element_type=jnp.float32)


def _valid_tokens(num_valid: jax.Array, num_tokens: int) -> jax.Array:
    """bool[S, T]: slot t of row s holds a real token."""
    return jnp.arange(num_tokens)[None, :] < num_valid[:, None]


# ---------------------------------------------------------------------------------------------------- conv
def causal_conv(mixed: jax.Array, weight: jax.Array, conv_state: jax.Array,
                num_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(f32[S, T, C] silu of the depthwise causal conv, new conv_state [S, K-1, C]) of pre-conv rows mixed [S, T, C]
    with weight [C, K] (conv1d.weight[:, 0, :]) after conv_state [S, K-1, C], the K - 1 previous pre-conv rows
    (zeros at a sequence's start): y[t, c] = silu(sum_j weight[c, j] xx[t + j, c]), xx = [conv_state ; mixed].
    The new state is the last K - 1 rows of xx up to row s's num_valid[s] tokens (state rows too when fewer than
    K - 1 are valid; the same state when none is). Outputs at padding slots are garbage: callers drop them."""
    num_tokens, taps = mixed.shape[1], weight.shape[1]
    xx = jnp.concatenate([conv_state, mixed.astype(conv_state.dtype)], axis=1)  # [S, K-1+T, C]
    xx32, w32 = xx.astype(jnp.float32), weight.astype(jnp.float32)
    y = sum(xx32[:, j:j + num_tokens] * w32[:, j] for j in range(taps))
    rows = num_valid[:, None] + jnp.arange(taps - 1)[None, :]  # [S, K-1]: xx rows just before the first pad
    new_state = jnp.take_along_axis(xx, rows[:, :, None], axis=1)
    return jax.nn.silu(y), new_state


# --------------------------------------------------------------------------------------------------- gates
def softplus(x: jax.Array) -> jax.Array:
    """torch's softplus (beta 1, threshold 20): x above the threshold, log(1 + e^x) below."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def gates(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(g, beta), f32 like a and b [..., nv]: the log decay g = -exp(A_log) softplus(a + dt_bias) <= 0 and the
    write strength beta = sigmoid(b)."""
    a32 = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    g = -jnp.exp(a_log.astype(jnp.float32)) * softplus(a32)
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (a sum, not RMSNorm's mean), in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """q, k [..., nk, dk] -> f32[..., nv, dk] as the recurrence reads them: l2-normalised over dk, q scaled by
    dk^-0.5, each key head repeated for the nv / nk value heads it serves (value head h reads key head h // r)."""
    ratio = num_value_heads // q.shape[-2]
    q = l2norm(q) * q.shape[-1] ** -0.5
    return jnp.repeat(q, ratio, axis=-2), jnp.repeat(l2norm(k), ratio, axis=-2)


# ----------------------------------------------------------------------------------------- the recurrence
def gated_delta_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                     valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One token per row, the recurrent form: (o f32[S, nv, dv], new state f32[S, nv, dk, dv]) of q, k [S, nv, dk]
    (from `prepare_qk`), v [S, nv, dv], g, beta [S, nv] after state [S, nv, dk, dv]. A row with valid[s] False
    (bool[S]; None: all valid) keeps its state exactly and outputs zeros."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    decayed = state * jnp.exp(g)[..., None, None]
    delta = beta[..., None] * (v - _dot("snkv,snk->snv", decayed, k))  # beta (v - S^T k)
    new_state = decayed + k[..., :, None] * delta[..., None, :]
    out = _dot("snkv,snk->snv", new_state, q)
    if valid is None:
        return out, new_state
    return jnp.where(valid[:, None, None], out, 0.0), jnp.where(valid[:, None, None, None], new_state, state)


def gated_delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                          state: jax.Array, num_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The plain form of `gated_delta_chunked` (same arguments and results): `gated_delta_step` over the tokens, one
    at a time (a scan of T steps). The reference the chunkwise form is measured against."""
    valid = _valid_tokens(num_valid, q.shape[1])

    def step(carry, xs):
        *token, valid_token = xs
        out, carry = gated_delta_step(*token, carry, valid_token)
        return carry, out

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta, valid))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.swapaxes(out, 0, 1), state


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^-1 of strictly lower triangular matrices [..., C, C] (C a power of 2; only the strictly lower
    triangle is read) in matrix products only. Doubling the solved diagonal blocks from 1 x 1 to C x C: with T the
    inverse of the blocks of size b, T <- T - T L_b T, L_b the part of ``lower`` between the halves of each block of
    2b (the block formula [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]] for every block at once); log2(C)
    rounds of two batched C x C products. The new corners land where T is 0, so the update is a select, exact: as a
    subtraction fused into the product, libtpu 0.0.42.1's compiler failed a register-allocation check (RET_CHECK in
    live_range_finder.cc) on most small shapes, intermittently (the same program compiled, then failed).

    In place of `lax.linalg.triangular_solve`, measured on a shared 2-core EPYC at Qwen3-Next's shape (1024 chunks of
    64): XLA:CPU's solve slowed the whole chunkwise form 3-13x (0.35 s to 4.5 s for 2048 tokens) when XLA fused its
    operands' producers into it, and again when another process took a core; the products do neither, and come closer
    to a float64 solve (8e-7 against 1.5e-6). On TPU they are plain MXU work. Blocks reshaped out of the matrices
    (fewer flops) ran no faster on CPU and compiled for TPU 2x slower into 2-5x the code."""
    size = lower.shape[-1]
    assert size & (size - 1) == 0, f"{size} is not a power of 2"
    rows, cols = np.arange(size)[:, None], np.arange(size)[None, :]
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=lower.dtype), lower.shape)
    block = 1
    while block < size:
        between_halves = (rows // (2 * block) == cols // (2 * block)) & (rows // block > cols // block)
        corner = _dot("...ij,...jk->...ik", inverse, _dot("...ij,...jk->...ik", jnp.where(between_halves, -lower, 0.0),
                                                            inverse))  # -D^-1 B A^-1 where T is 0, 0 elsewhere
        inverse = jnp.where(between_halves, corner, inverse)
        block *= 2
    return inverse


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[S, T, nv, ...] (T a multiple of chunk) -> [T / chunk, S, nv, chunk, ...]: chunks first, for the scan."""
    s, t, h = x.shape[:3]
    x = x.reshape(s, t // chunk, chunk, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 2).swapaxes(0, 1)


def gated_delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
                        num_valid: jax.Array, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The chunkwise form, for prefill rows: (o f32[S, T, nv, dv], new state f32[S, nv, dk, dv]) of q, k [S, T, nv, dk]
    (from `prepare_qk`), v [S, T, nv, dv], g, beta [S, T, nv] after state [S, nv, dk, dv]; the first num_valid[s]
    tokens of row s are real, the rest exact no-ops (their outputs zeros). Rows never mix. Chunks of ``chunk`` tokens
    (a power of 2; fewer for a shorter T: the next power of 2), T padded to a multiple with no-op tokens."""
    num_tokens = q.shape[1]
    valid = _valid_tokens(num_valid, num_tokens)
    q, k, v = (jnp.where(valid[..., None, None], x.astype(jnp.float32), 0.0) for x in (q, k, v))
    g, beta = (jnp.where(valid[..., None], x.astype(jnp.float32), 0.0) for x in (g, beta))
    chunk = min(chunk, 1 << (num_tokens - 1).bit_length())  # a power of 2 (`unit_lower_inverse`)
    pad = -num_tokens % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    q, k, v = (_chunks(x, chunk) for x in (q, k, v))  # [N, S, nv, C, d]
    g, beta = (_chunks(x, chunk) for x in (g, beta))  # [N, S, nv, C]

    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair_decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # exp(c_i - c_j), j <= i
    k_beta = k * beta[..., None]
    ut_system = _dot("...id,...jd->...ij", k_beta, k) * pair_decay  # its strictly lower part is read
    intra = _dot("...id,...jd->...ij", q, k) * pair_decay  # the chunk's own attention, diagonal included
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = _dot("...ij,...jd->...id", unit_lower_inverse(ut_system), rhs)
    new_values, k_cumdecay = jnp.split(solved, [v.shape[-1]], axis=-1)  # U and W: (I + ut_system)^-1 [v_b | k_b e^c]
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def scan_chunk(s, xs):
        new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay = xs
        v_new = new_values - _dot("...ck,...kv->...cv", k_cumdecay, s)
        out = _dot("...ck,...kv->...cv", q_decayed, s) + _dot("...ij,...jv->...iv", intra, v_new)
        return s * chunk_decay + _dot("...ck,...cv->...kv", k_decayed, v_new), out

    xs = (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay)
    state, out = jax.lax.scan(scan_chunk, state.astype(jnp.float32), xs)  # out [N, S, nv, C, dv]
    out = jnp.moveaxis(out.swapaxes(0, 1), 2, 3)  # [S, N, C, nv, dv]
    return out.reshape(out.shape[0], -1, *out.shape[3:])[:, :num_tokens], state


# ------------------------------------------------------------------------------------------------- output
def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """f32 weight * o / rms(o) * silu(z) over the last axis (dv, per head): the plain weight, not 1 + weight."""
    o32 = o.astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * normed * jax.nn.silu(z.astype(jnp.float32))


# -------------------------------------------------------------------------------------------- whole layer
class GatedDeltaNetParams(NamedTuple):
    """A layer's weights in Qwen3.5's layout, kernels [in, out] (the house's `Linear` layout)."""

    in_proj_qkv: jax.Array  # [H, conv_dim]: [q | k | v], heads major
    in_proj_z: jax.Array  # [H, nv * dv]
    in_proj_b: jax.Array  # [H, nv]
    in_proj_a: jax.Array  # [H, nv]
    conv1d: jax.Array  # [conv_dim, K]
    dt_bias: jax.Array  # [nv]
    a_log: jax.Array  # [nv]
    norm: jax.Array  # [dv]
    out_proj: jax.Array  # [nv * dv, H]


def qwen3next_to_qwen35_weights(in_proj_qkvz, in_proj_ba, dims: GatedDeltaNetDims):
    """Qwen3-Next's fused projections (torch rows [out, H]: per key head [q dk | k dk | v r dv | z r dv] and
    [b r | a r], r = nv / nk) row-permuted to Qwen3.5's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), same layout.
    A permutation: exact. Works on numpy arrays (at load time) and jax arrays."""
    nk, dk, dv = dims.num_key_heads, dims.key_head_dim, dims.value_head_dim
    ratio = dims.num_value_heads // nk
    per_head = in_proj_qkvz.reshape(nk, 2 * dk + 2 * ratio * dv, -1)
    rows = lambda x: x.reshape(-1, x.shape[-1])
    q, k = rows(per_head[:, :dk]), rows(per_head[:, dk:2 * dk])
    v, z = rows(per_head[:, 2 * dk:2 * dk + ratio * dv]), rows(per_head[:, 2 * dk + ratio * dv:])
    ba = in_proj_ba.reshape(nk, 2 * ratio, -1)
    concat = np.concatenate if isinstance(in_proj_qkvz, np.ndarray) else jnp.concatenate
    return concat([q, k, v], axis=0), z, rows(ba[:, :ratio]), rows(ba[:, ratio:])


def params_from_hf(weights: Mapping[str, np.ndarray], dims: GatedDeltaNetDims, dtype) -> GatedDeltaNetParams:
    """A layer's `GatedDeltaNetParams` in ``dtype`` (A_log and dt_bias kept float32) from its transformers
    weights (keys relative to `linear_attn.`, torch layouts), Qwen3-Next's fused projections or Qwen3.5's split."""
    w = {name: np.asarray(x) for name, x in weights.items()}
    if "in_proj_qkvz.weight" in w:
        qkv, z, b, a = qwen3next_to_qwen35_weights(w["in_proj_qkvz.weight"], w["in_proj_ba.weight"], dims)
    else:
        qkv, z, b, a = (w[f"in_proj_{name}.weight"] for name in ("qkv", "z", "b", "a"))
    kernel = lambda x: jnp.asarray(x.T, dtype)
    return GatedDeltaNetParams(
        in_proj_qkv=kernel(qkv), in_proj_z=kernel(z), in_proj_b=kernel(b), in_proj_a=kernel(a),
        conv1d=jnp.asarray(w["conv1d.weight"][:, 0, :], dtype), dt_bias=jnp.asarray(w["dt_bias"], jnp.float32),
        a_log=jnp.asarray(w["A_log"], jnp.float32), norm=jnp.asarray(w["norm.weight"], dtype),
        out_proj=kernel(w["out_proj.weight"]))


def gated_deltanet_core(params: GatedDeltaNetParams, dims: GatedDeltaNetDims, x: jax.Array, conv_state: jax.Array,
                        state: jax.Array, num_valid: jax.Array, chunk: int = CHUNK):
    """(core output f32[S, T, nv, dv] before the gated norm, z f32[S, T, nv, dv], new conv_state, new state) of
    hidden states x [S, T, H]: rows of one token (T = 1) in the recurrent form, longer ones chunkwise."""
    s, t = x.shape[:2]
    nk, nv, dk, dv = dims
    conv_out, conv_state = causal_conv(matmul(x, params.in_proj_qkv), params.conv1d, conv_state, num_valid)
    q, k, v = jnp.split(conv_out, [dims.key_dim, 2 * dims.key_dim], axis=-1)
    q, k = prepare_qk(q.reshape(s, t, nk, dk), k.reshape(s, t, nk, dk), nv)
    v = v.reshape(s, t, nv, dv)
    g, beta = gates(matmul(x, params.in_proj_a), matmul(x, params.in_proj_b), params.a_log, params.dt_bias)
    if t == 1:
        core, state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, num_valid > 0)
        core = core[:, None]
    else:
        core, state = gated_delta_chunked(q, k, v, g, beta, state, num_valid, chunk)
    z = matmul(x, params.in_proj_z).reshape(s, t, nv, dv)
    return core, z, conv_state, state


def gated_deltanet_layer(params: GatedDeltaNetParams, dims: GatedDeltaNetDims, x: jax.Array, conv_state: jax.Array,
                         state: jax.Array, num_valid: jax.Array, eps: float, chunk: int = CHUNK):
    """The whole mixer: (f32[S, T, H] output, new conv_state [S, K-1, conv_dim], new state f32[S, nv, dk, dv]) of
    hidden states x [S, T, H] (after the input norm) of right-padded rows with num_valid i32[S] real tokens each,
    continuing from conv_state and state (zeros for a new sequence). eps is the config's rms_norm_eps."""
    core, z, conv_state, state = gated_deltanet_core(params, dims, x, conv_state, state, num_valid, chunk)
    normed = gated_rms_norm(core, z, params.norm, eps)
    return matmul(normed.reshape(*x.shape[:2], dims.value_dim), params.out_proj), conv_state, state
