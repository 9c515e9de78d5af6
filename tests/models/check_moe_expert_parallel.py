"""Expert parallelism of the MoE block on 4 virtual CPU devices. Not collected by the main test run (its
name does not match test_*.py): tests/models/test_moe.py runs it in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4, since the flag must be set before JAX starts and the
rest of the suite runs on one device."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.distributed.sharding import make_mesh, param_shardings, replicated
from jaxserve.models.moe import SparseMoeBlock

assert jax.device_count() == 4, f"run with XLA_FLAGS=--xla_force_host_platform_device_count=4 ({os.environ})"

HIDDEN, NUM_EXPERTS = 16, 8
VARIANTS = {  # Qwen3-MoE / Mixtral-like (routed experts only) and Qwen2-MoE-like (with a shared expert)
    "routed": dict(num_experts_per_tok=2, norm_topk_prob=True),
    "shared": dict(num_experts_per_tok=3, norm_topk_prob=False, shared_expert_intermediate_size=20),
}


def _block(variant: str, mesh=None, num_experts: int = NUM_EXPERTS) -> SparseMoeBlock:
    return SparseMoeBlock(num_experts=num_experts, intermediate_size=12, hidden_act="silu", dtype=jnp.float32,
                          mesh=mesh, **VARIANTS[variant])


@functools.cache
def _inputs(variant: str):
    """x f32[2, 7, hidden] and random parameters (numpy's generator: initializing through JAX compiles for
    seconds); the router is sharper than the rest, so that the experts get uneven token counts."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 7, HIDDEN)), jnp.float32)
    shapes = jax.eval_shape(_block(variant).init, jax.random.key(0), x)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), s.dtype), shapes)
    params["params"]["router"]["kernel"] = params["params"]["router"]["kernel"] * 5
    return x, params


@functools.cache
def _step(variant: str, tp: int | None):
    """The block compiled unsharded (tp None) or on a mesh of tp devices, its parameters placed by
    `param_shardings` (so the shard_map's specs and the rule table must agree for no resharding)."""
    x, params = _inputs(variant)
    if tp is None:
        return jax.jit(_block(variant).apply).lower(params, x).compile()
    mesh = make_mesh(tp)
    step = jax.jit(_block(variant, mesh).apply, in_shardings=(param_shardings(params, mesh), replicated(mesh)))
    return step.lower(params, x).compile()


@pytest.mark.parametrize("variant", VARIANTS)
def test_meshes_of_1_2_4_devices_give_the_unsharded_outputs(variant):
    x, params = _inputs(variant)
    expected = np.asarray(_step(variant, None)(params, x))
    for tp in (1, 2, 4):
        out = np.asarray(_step(variant, tp)(params, x))
        np.testing.assert_allclose(out, expected, atol=1e-6, rtol=0, err_msg=f"tp {tp}")


def test_one_token_gathers_its_experts_on_every_mesh():
    """A decode row (k = 2 assignments, no more than each device's experts): the gathered-weights path, each
    device's experts offset by its place on the mesh."""
    _, params = _inputs("routed")
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 1, HIDDEN)), jnp.float32)
    expected = np.asarray(jax.jit(_block("routed").apply)(params, x))
    for tp in (1, 2, 4):
        mesh = make_mesh(tp)
        step = jax.jit(_block("routed", mesh).apply, in_shardings=(param_shardings(params, mesh), replicated(mesh)))
        np.testing.assert_allclose(np.asarray(step(params, x)), expected, atol=1e-6, rtol=0, err_msg=f"tp {tp}")


def test_each_device_holds_its_share_of_the_experts():
    x, params = _inputs("shared")
    shardings = param_shardings(params, make_mesh(4))["params"]
    experts = {name: s.shard_shape(params["params"]["experts"][name].shape)
               for name, s in shardings["experts"].items()}
    assert experts == {"gate_proj": (2, 16, 12), "up_proj": (2, 16, 12), "down_proj": (2, 12, 16)}
    assert shardings["router"]["kernel"].is_fully_replicated
    assert shardings["shared_expert_gate"]["kernel"].is_fully_replicated
    shared = {name: s["kernel"].shard_shape(params["params"]["shared_expert"][name]["kernel"].shape)
              for name, s in shardings["shared_expert"].items()}
    assert shared == {"gate_proj": (16, 5), "up_proj": (16, 5), "down_proj": (5, 16)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tp_2_block_communicates_one_all_reduce_and_nothing_else(variant):
    hlo = _step(variant, 2).as_text()
    collectives = re.findall(
        r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", hlo
    )
    assert [(shape.split("{")[0], op) for shape, op in collectives] == [("f32[14,16]", "all-reduce")]


def test_non_finite_padding_tokens_leave_the_real_tokens_alone_under_tp_2():
    x, params = _inputs("shared")
    padded = x.at[1, 4].set(jnp.inf).at[1, 5].set(jnp.nan).at[1, 6].set(1e30)
    step = _step("shared", 2)
    clean, out = np.asarray(step(params, x)), np.asarray(step(params, padded))
    np.testing.assert_allclose(out[0], clean[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(out[1, :4], clean[1, :4], atol=1e-6, rtol=0)


def test_experts_that_do_not_divide_by_the_mesh_are_refused():
    x = jnp.zeros((2, 7, HIDDEN), jnp.float32)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        jax.eval_shape(_block("routed", make_mesh(4), num_experts=6).init, jax.random.key(0), x)
    shared_6 = _block("shared", make_mesh(4)).clone(shared_expert_intermediate_size=6)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(6\) is not divisible by .* \(4\)"):
        jax.eval_shape(shared_6.init, jax.random.key(0), x)
