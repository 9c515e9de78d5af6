"""The gated DeltaNet functions (jaxserve/models/gated_deltanet.py) against transformers' torch fallback of
Qwen3-Next / Qwen3.5, in float32 at tiny held-out dims (nk=2, nv=4, dk=16, dv=24, K=4): the chunkwise form against
torch_chunk_gated_delta_rule (longer than a chunk, from a state), the step against torch_recurrent_gated_delta_rule,
the conv against causal_conv1d_update / causal_conv1d_fn; right-padded bucket rows against each sequence alone;
chunked prefill then decode steps against one pass; the whole layer against Qwen3NextGatedDeltaNet and
Qwen3_5GatedDeltaNet (no cache, and a cached prefill split in two then decode steps); the prefill and decode
programs compiled deviceless for TPU (scripts/bench_gated_deltanet.py's, at these dims).

Tolerances are absolute, a few times the largest difference measured (float32, 2-core EPYC): the recurrence's
outputs are O(1), its state O(1); the layer's outputs are O(30) and its gated RMSNorm amplifies rounding in rows of
tiny variance (transformers itself is 2.6e-4 from a float64 truth there), so the layer is compared at 1e-3 and its
core output (before the norm) at 2e-5.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from jaxserve.models import gated_deltanet as gdn
from tests.paths import load_script

NK, NV, DK, DV, TAPS, HIDDEN = 2, 4, 16, 24, 4, 64
DIMS = gdn.GatedDeltaNetDims(NK, NV, DK, DV)
CONV_DIM = DIMS.conv_dim
EPS = 1e-6
# per value head: A = exp(A_log) and the time step softplus(dt_bias) (Mamba's init, as Qwen3-Next's), so that the
# heads' decays per token span ~0.9999 (a long memory: the initial state and earlier chunks matter) to ~0.25
HEAD_A = np.array([0.05, 0.8, 4.0, 14.0], np.float32)
HEAD_DT = np.array([0.002, 0.01, 0.05, 0.1], np.float32)
A_LOG, DT_BIAS = np.log(HEAD_A), np.log(np.expm1(HEAD_DT)).astype(np.float32)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _inputs(seed: int, rows: int, tokens: int) -> dict[str, np.ndarray]:
    """Raw q, k [S, T, nk, dk], v [S, T, nv, dv], the gates' g and beta [S, T, nv] of random a, b, and an initial
    state [S, nv, dk, dv] of scale ~1."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    g, beta = gdn.gates(jnp.asarray(0.5 * normal(rows, tokens, NV)), jnp.asarray(normal(rows, tokens, NV)),
                        jnp.asarray(A_LOG), jnp.asarray(DT_BIAS))
    return dict(q=normal(rows, tokens, NK, DK), k=normal(rows, tokens, NK, DK), v=normal(rows, tokens, NV, DV),
                g=np.asarray(g), beta=np.asarray(beta), state=0.3 * normal(rows, NV, DK, DV))


def _torch_rule(rule, x: dict[str, np.ndarray], initial: bool = True, **kwargs):
    """transformers' chunk or recurrent rule on raw q, k (it normalises and repeats them itself)."""
    t = {name: torch.from_numpy(np.array(value)) for name, value in x.items()}
    out, state = rule(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=t["state"] if initial else None,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    return out.numpy(), state.numpy()


@functools.partial(jax.jit, static_argnames=("chunk", "form"))
def _core(q, k, v, g, beta, state, num_valid, chunk=gdn.CHUNK, form="chunked"):
    q, k = gdn.prepare_qk(q, k, NV)
    if form == "chunked":
        return gdn.gated_delta_chunked(q, k, v, g, beta, state, num_valid, chunk)
    return gdn.gated_delta_recurrent(q, k, v, g, beta, state, num_valid)


@jax.jit
def _step(q, k, v, g, beta, state, valid):
    q, k = gdn.prepare_qk(q, k, NV)
    return gdn.gated_delta_step(q, k, v, g, beta, state, valid)


def test_gates_and_l2norm_equal_torch():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, NV)).astype(np.float32) * 8
    a[0] = [25.0, 19.9, 20.1, -30.0]  # both sides of softplus's threshold
    b = rng.standard_normal((5, NV)).astype(np.float32)
    a_log, dt_bias = np.log(rng.uniform(0.01, 16, NV)).astype(np.float32), rng.standard_normal(NV).astype(np.float32)
    g, beta = gdn.gates(jnp.asarray(a), jnp.asarray(b), jnp.asarray(a_log), jnp.asarray(dt_bias))
    t = lambda x: torch.from_numpy(x)
    g_hf = -t(a_log).float().exp() * F.softplus(t(a).float() + t(dt_bias))
    np.testing.assert_allclose(np.asarray(g), g_hf.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.asarray(beta), t(b).sigmoid().numpy(), rtol=1e-6, atol=0)
    x = rng.standard_normal((3, NK, DK)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(gdn.l2norm(jnp.asarray(x))), hf.l2norm(t(x)).numpy(), rtol=0, atol=1e-6)


def test_unit_lower_inverse_inverts_with_the_upper_triangle_ignored():
    rng = np.random.default_rng(12)
    for size in (1, 2, 16, 64):
        matrices = rng.standard_normal((3, 2, size, size)).astype(np.float32)
        lower = np.tril(matrices, -1) * 0.3
        inverse = np.asarray(jax.jit(gdn.unit_lower_inverse)(lower + np.triu(matrices)))  # garbage not read
        np.testing.assert_allclose(inverse, np.linalg.inv(np.eye(size) + lower.astype(np.float64)), rtol=0,
                                   atol=1e-5 * max(1.0, np.abs(inverse).max()))
        assert not np.triu(inverse, 1).any() and (np.diagonal(inverse, axis1=-2, axis2=-1) == 1).all()


@pytest.mark.parametrize("initial", [False, True], ids=["from_zero", "continuation"])
def test_chunked_equals_torch_chunk_rule_over_several_chunks(initial):
    """150 tokens = 3 chunks of 64 (the last one padded by the form itself), two sequences."""
    x = _inputs(1, rows=2, tokens=150)
    state = x["state"] if initial else np.zeros_like(x["state"])
    out, final = _core(x["q"], x["k"], x["v"], x["g"], x["beta"], state, jnp.array([150, 150]), chunk=64)
    out_hf, final_hf = _torch_rule(hf.torch_chunk_gated_delta_rule, x, initial, chunk_size=64)
    print(f"chunked vs torch chunk rule ({'from a state' if initial else 'from zero'}): "
          f"output {_max_diff(out, out_hf):.2e} (scale {np.abs(out_hf).max():.2f}), "
          f"state {_max_diff(final, final_hf):.2e} (scale {np.abs(final_hf).max():.2f})")
    np.testing.assert_allclose(np.asarray(out), out_hf, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), final_hf, rtol=0, atol=1e-5)
    if initial:  # the heads of long memory still read the initial state at the end
        out_zero, _ = _torch_rule(hf.torch_chunk_gated_delta_rule, x, initial=False, chunk_size=64)
        assert _max_diff(out_hf[:, -10:], out_zero[:, -10:]) > 1e-3
    # the chunkwise form and the plain one are the same recurrence
    out_r, final_r = _core(x["q"], x["k"], x["v"], x["g"], x["beta"], state, jnp.array([150, 150]), form="recurrent")
    print(f"chunked vs recurrent (jax): output {_max_diff(out, out_r):.2e}, state {_max_diff(final, final_r):.2e}")
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_r), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_r), rtol=0, atol=1e-5)


def test_step_equals_torch_recurrent_rule_token_by_token():
    """20 decode steps of 3 rows: row 0 every step, row 1 every other step (its other steps are padding rows with
    garbage values), row 2 never (its state must not change at all)."""
    x = _inputs(2, rows=3, tokens=20)
    rng = np.random.default_rng(3)
    valid = np.zeros((3, 20), bool)
    valid[0], valid[1, ::2] = True, True
    state = jnp.asarray(x["state"])
    outs = []
    for t in range(20):
        token = {n: x[n][:, t].copy() for n in ("q", "k", "v", "g", "beta")}
        for n in token:  # garbage in the invalid rows
            token[n][~valid[:, t]] = rng.standard_normal(token[n][~valid[:, t]].shape) * 50
        out, state = _step(*(token[n] for n in ("q", "k", "v", "g", "beta")), state, jnp.asarray(valid[:, t]))
        outs.append(np.asarray(out))
    outs = np.stack(outs, axis=1)  # [S, T, nv, dv]
    worst = 0.0
    for row in (0, 1):
        mine = {n: x[n][row:row + 1, valid[row]] for n in ("q", "k", "v", "g", "beta")}
        mine["state"] = x["state"][row:row + 1]
        out_hf, final_hf = _torch_rule(hf.torch_recurrent_gated_delta_rule, mine)
        worst = max(worst, _max_diff(outs[row, valid[row]], out_hf[0]), _max_diff(state[row], final_hf[0]))
        np.testing.assert_allclose(outs[row, valid[row]], out_hf[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(state[row]), final_hf[0], rtol=0, atol=1e-5)
    print(f"step vs torch recurrent rule: {worst:.2e}")
    np.testing.assert_array_equal(np.asarray(state[2]), x["state"][2])
    assert not outs[2].any() and not outs[1, ~valid[1]].any()


def test_chunked_padded_rows_equal_each_sequence_alone():
    """A bucket of 4 rows of 160 slots holding 150, 37, 0 and 64 tokens, NaN and inf in the padding: each row's
    outputs and state are its sequence's alone; the empty row keeps its state bit for bit."""
    lengths = [150, 37, 0, 64]
    x = _inputs(4, rows=4, tokens=160)
    padded = {n: x[n].copy() for n in ("q", "k", "v", "g", "beta")}
    for row, length in enumerate(lengths):
        for n in padded:
            padded[n][row, length:] = np.nan if row % 2 else np.inf
    args = [padded[n] for n in ("q", "k", "v", "g", "beta")]
    out, final = _core(*args, x["state"], jnp.array(lengths))
    out, final = np.asarray(out), np.asarray(final)
    assert np.isfinite(out).all() and np.isfinite(final).all()
    worst = 0.0
    for row, length in enumerate(lengths):
        if length == 0:
            np.testing.assert_array_equal(final[row], x["state"][row])
            assert not out[row].any()
            continue
        alone = [x[n][row:row + 1, :length] for n in ("q", "k", "v", "g", "beta")]
        out_a, final_a = _core(*alone, x["state"][row:row + 1], jnp.array([length]))
        worst = max(worst, _max_diff(out[row, :length], out_a[0]), _max_diff(final[row], final_a[0]))
        np.testing.assert_allclose(out[row, :length], np.asarray(out_a[0]), rtol=0, atol=1e-6)
        np.testing.assert_allclose(final[row], np.asarray(final_a[0]), rtol=0, atol=1e-6)
        assert not out[row, length:].any()
    print(f"padded bucket rows vs each sequence alone: {worst:.2e}")


# ------------------------------------------------------------------------------------------------------ conv
def _conv_inputs(seed: int, rows: int, tokens: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, tokens, CONV_DIM)).astype(np.float32),
            (0.5 * rng.standard_normal((CONV_DIM, TAPS))).astype(np.float32),
            rng.standard_normal((rows, TAPS - 1, CONV_DIM)).astype(np.float32))


_conv = jax.jit(gdn.causal_conv)


def _torch_conv_update(mixed, weight, conv_state):
    """transformers' causal_conv1d_update (time last, the state updated in place)."""
    state = torch.from_numpy(conv_state.transpose(0, 2, 1).copy())
    out = hf.causal_conv1d_update(torch.from_numpy(mixed.transpose(0, 2, 1).copy()), state,
                                  torch.from_numpy(weight), None, "silu")
    return out.numpy().transpose(0, 2, 1), state.numpy().transpose(0, 2, 1)


def test_conv_equals_torch_conv_update_and_first_prefill():
    mixed, weight, conv_state = _conv_inputs(5, rows=2, tokens=7)
    y, new_state = _conv(mixed, weight, conv_state, jnp.array([7, 7]))
    y_hf, state_hf = _torch_conv_update(mixed, weight, conv_state)
    print(f"conv vs causal_conv1d_update: {_max_diff(y, y_hf):.2e}")
    np.testing.assert_allclose(np.asarray(y), y_hf, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_state), state_hf)
    # a sequence's first chunk: the layer's causal_conv1d_fn (zero padding on the left)
    y0, _ = _conv(mixed, weight, np.zeros_like(conv_state), jnp.array([7, 7]))
    y_fn = hf.causal_conv1d_fn(torch.from_numpy(mixed.transpose(0, 2, 1).copy()), torch.from_numpy(weight),
                               None, activation="silu").numpy().transpose(0, 2, 1)
    print(f"conv from zeros vs causal_conv1d_fn: {_max_diff(y0, y_fn):.2e}")
    np.testing.assert_allclose(np.asarray(y0), y_fn, rtol=0, atol=1e-6)


def test_conv_state_carries_across_chunks_and_padded_rows():
    """A prompt of 11 split 5 + 6 equals it whole; rows with 2 (< K - 1) and 0 valid of 7 slots (garbage after)
    equal their valid tokens alone, and the empty row keeps its state."""
    mixed, weight, conv_state = _conv_inputs(6, rows=1, tokens=11)
    y, state = _conv(mixed, weight, conv_state, jnp.array([11]))
    y1, state1 = _conv(mixed[:, :5], weight, conv_state, jnp.array([5]))
    y2, state2 = _conv(mixed[:, 5:], weight, state1, jnp.array([6]))
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), np.asarray(y), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state2), np.asarray(state))

    mixed, weight, conv_state = _conv_inputs(7, rows=3, tokens=7)
    mixed[0, 2:], mixed[1] = np.nan, np.inf
    y, state = _conv(mixed, weight, conv_state, jnp.array([2, 0, 7]))
    for row, length in ((0, 2), (2, 7)):
        y_hf, state_hf = _torch_conv_update(mixed[row:row + 1, :length], weight, conv_state[row:row + 1])
        np.testing.assert_allclose(np.asarray(y[row, :length]), y_hf[0], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(state[row]), state_hf[0])
    np.testing.assert_array_equal(np.asarray(state[0]), np.concatenate([conv_state[0, 2:], mixed[0, :2]]))
    np.testing.assert_array_equal(np.asarray(state[1]), conv_state[1])


# ------------------------------------------------------------------------------------------------ the layer
def _hf_config(cls):
    return cls(hidden_size=HIDDEN, linear_conv_kernel_dim=TAPS, linear_key_head_dim=DK, linear_value_head_dim=DV,
               linear_num_key_heads=NK, linear_num_value_heads=NV, num_hidden_layers=1,
               layer_types=["linear_attention"], rms_norm_eps=EPS, hidden_act="silu")


@functools.cache
def _torch_layers():
    """transformers' Qwen3-Next layer with random weights (every parameter perturbed, so that a norm offset or a
    permuted projection shows; A_log and dt_bias per head as `HEAD_A` and `HEAD_DT` say), and Qwen3.5's with the
    same weights in its split layout."""
    torch.manual_seed(0)
    next_config = _hf_config(Qwen3NextConfig)
    layer = hf.Qwen3NextGatedDeltaNet(next_config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.from_numpy(A_LOG))
            elif name == "dt_bias":
                param.copy_(torch.from_numpy(DT_BIAS))
            elif name == "norm.weight":
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    weights = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    qkv, z, b, a = gdn.qwen3next_to_qwen35_weights(weights["in_proj_qkvz.weight"], weights["in_proj_ba.weight"], DIMS)
    layer35 = Qwen3_5GatedDeltaNet(_hf_config(Qwen3_5TextConfig), 0).eval()
    with torch.no_grad():
        for name, param in layer35.named_parameters():
            split = {"in_proj_qkv.weight": qkv, "in_proj_z.weight": z, "in_proj_b.weight": b, "in_proj_a.weight": a}
            param.copy_(torch.from_numpy(split[name]) if name in split else layer.get_parameter(name))
    return layer, layer35, next_config


def _params(layer) -> gdn.GatedDeltaNetParams:
    return gdn.params_from_hf({n: p.detach().numpy() for n, p in layer.named_parameters()}, DIMS, jnp.float32)


@functools.partial(jax.jit, static_argnames=("core",))
def _layer(params, x, conv_state, state, num_valid, core=False):
    if core:
        return gdn.gated_deltanet_core(params, DIMS, x, conv_state, state, num_valid)
    return gdn.gated_deltanet_layer(params, DIMS, x, conv_state, state, num_valid, EPS)


def _zero_states(rows: int):
    return jnp.zeros((rows, TAPS - 1, CONV_DIM)), jnp.zeros((rows, NV, DK, DV))


def _hidden(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, tokens, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_layer_equals_transformers_forward(family):
    """150 tokens from a new sequence (no cache: transformers' chunked path), the core output captured before
    the gated norm."""
    layer_next, layer35, _ = _torch_layers()
    layer = layer_next if family == "qwen3_next" else layer35
    x = _hidden(8, 150)
    captured = {}
    hook = layer.norm.register_forward_hook(lambda m, i, o: captured.update(core=i[0].detach().numpy().copy()))
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    hook.remove()
    params = _params(layer)
    out, _, _ = _layer(params, x, *_zero_states(1), jnp.array([150]))
    core, _, _, _ = _layer(params, x, *_zero_states(1), jnp.array([150]), core=True)
    core_diff, out_diff = _max_diff(core.reshape(-1, DV), captured["core"]), _max_diff(out, expected)
    print(f"{family} layer: core {core_diff:.2e} (scale {np.abs(captured['core']).max():.2f}), "
          f"output {out_diff:.2e} (scale {np.abs(expected).max():.1f})")
    np.testing.assert_allclose(np.asarray(core).reshape(-1, DV), captured["core"], rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=0, atol=1e-3)


def test_layer_prefill_in_chunks_then_decode_equals_transformers_cache_and_one_pass():
    """transformers with a DynamicCache: prefill 70, prefill 80 (a continuation), 6 decode steps. Here: the first
    chunk in a padded bucket of 96 slots beside an empty row, the second alone, the decode steps in a bucket of
    2 rows whose second is padding; against that, and against all 156 tokens in one chunked pass."""
    layer, _, config = _torch_layers()
    x = _hidden(9, 156)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        expected = [layer(torch.from_numpy(x[:, :70]), cache=cache), layer(torch.from_numpy(x[:, 70:150]), cache=cache)]
        conv_hf = cache.layers[0].conv_states[0].numpy().copy()  # [1, C, K] after the prompt: the last K - 1
        expected += [layer(torch.from_numpy(x[:, t:t + 1]), cache=cache) for t in range(150, 156)]
    expected = np.concatenate([e.numpy() for e in expected], axis=1)[0]
    state_hf = cache.layers[0].recurrent_states[0].numpy()

    params = _params(layer)
    bucket = np.random.default_rng(10).standard_normal((2, 96, HIDDEN)).astype(np.float32) * 100
    bucket[0, :70] = x[0, :70]
    conv_state, state = _zero_states(2)
    out1, conv_state, state = _layer(params, bucket, conv_state, state, jnp.array([70, 0]))
    assert not np.asarray(state[1]).any() and not np.asarray(conv_state[1]).any()
    out2, conv_state1, state1 = _layer(params, x[:, 70:150], conv_state[:1], state[:1], jnp.array([80]))
    conv_state, state = conv_state.at[0].set(conv_state1[0]), state.at[0].set(state1[0])
    decoded = []
    for t in range(150, 156):
        rows = np.stack([x[0, t:t + 1], np.full((1, HIDDEN), np.nan, np.float32)])
        out, conv_state, state = _layer(params, rows, conv_state, state, jnp.array([1, 0]))
        decoded.append(np.asarray(out[0]))
    mine = np.concatenate([np.asarray(out1[0, :70]), np.asarray(out2[0])] + decoded)
    print(f"prefill 70 + 80 + 6 decode vs transformers' cache: output {_max_diff(mine, expected):.2e}, "
          f"state {_max_diff(state[:1], state_hf):.2e}")
    np.testing.assert_allclose(mine, expected, rtol=0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(state[:1]), state_hf, rtol=0, atol=1e-5)
    # the conv state holds pre-conv rows x W_qkv: XLA's product and torch's round differently
    print(f"conv state after the prompt vs transformers' cache: {_max_diff(conv_state1[0], conv_hf[0, :, 1:].T):.2e}")
    np.testing.assert_allclose(np.asarray(conv_state1[0]), conv_hf[0, :, 1:].T, rtol=0, atol=1e-5)
    assert not np.asarray(state[1]).any() and not np.asarray(conv_state[1]).any()

    whole, whole_conv, whole_state = _layer(params, x, *_zero_states(1), jnp.array([156]))
    print(f"prefill 70 + 80 + 6 decode vs one pass of 156: output {_max_diff(mine, whole[0]):.2e}, "
          f"state {_max_diff(state[:1], whole_state):.2e}")
    np.testing.assert_allclose(mine, np.asarray(whole[0]), rtol=0, atol=1e-3)
    np.testing.assert_allclose(np.asarray(state[:1]), np.asarray(whole_state), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(conv_state[:1]), np.asarray(whole_conv), rtol=0, atol=1e-5)  # x W_qkv


def test_qwen3next_weights_permute_exactly_to_qwen35s_split():
    """transformers' own split of the fused projections (fix_query_key_value_ordering) equals the permuted
    weights' products exactly; Qwen3.5's layer with them equals Qwen3-Next's (same arithmetic)."""
    layer_next, layer35, _ = _torch_layers()
    x = torch.from_numpy(_hidden(11, 9))
    with torch.no_grad():
        q, k, v, z, b, a = layer_next.fix_query_key_value_ordering(layer_next.in_proj_qkvz(x), layer_next.in_proj_ba(x))
        mixed = torch.cat([t.reshape(1, 9, -1) for t in (q, k, v)], dim=-1)
        assert torch.equal(mixed, layer35.in_proj_qkv(x))
        assert torch.equal(z.reshape(1, 9, -1), layer35.in_proj_z(x))
        assert torch.equal(b, layer35.in_proj_b(x)) and torch.equal(a, layer35.in_proj_a(x))
        assert torch.equal(layer_next(x), layer35(x))


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_compiles_deviceless_for_tpu_with_the_states_donated(step):
    """scripts/bench_gated_deltanet.py's TPU programs (conv, gates, prepare_qk, then the chunkwise form or the step;
    bfloat16 rows, float32 state) at the tiny dims, 3 rows of 40 tokens (chunks of 16: the script's 64 compile 4x
    slower) or 1: the TPU compiler takes them and writes both states in place."""
    bench = load_script("bench_gated_deltanet")
    fn = functools.partial(bench.prefill, dims=DIMS, chunk=16) if step == "prefill" else functools.partial(
        bench.decode, dims=DIMS)
    tokens = 40 if step == "prefill" else 1
    compiled, _ = bench.compile_for_tpu(fn, "v6e:2x2", 3, tokens, dims=DIMS, taps=TAPS)
    # outputs (core, conv_state, state); arguments 6 and 7 the states
    assert "input_output_alias={ {1}: (6, {}, may-alias), {2}: (7, {}, may-alias) }" in compiled.as_text()
