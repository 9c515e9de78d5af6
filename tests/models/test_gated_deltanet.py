"""The gated DeltaNet functions (jaxserve/models/gated_deltanet.py) against transformers' torch fallback of
Qwen3-Next / Qwen3.5, in float32 at tiny held-out dims (nk=2, nv=4, dk=16, dv=24, K=4): the chunkwise form against
torch_chunk_gated_delta_rule (longer than a chunk, from a state), the step against torch_recurrent_gated_delta_rule,
the conv against causal_conv1d_update / causal_conv1d_fn; right-padded bucket rows against each sequence alone.

Tolerances are absolute, a few times the largest difference measured (float32, 2-core EPYC): outputs O(1),
states O(1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from jaxserve.models import gated_deltanet as gdn

NK, NV, DK, DV, TAPS, HIDDEN = 2, 4, 16, 24, 4, 64
CONV_DIM = 2 * NK * DK + NV * DV
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
