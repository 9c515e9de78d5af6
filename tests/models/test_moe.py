"""The sparse MoE block (jaxserve/models/moe.py) against transformers' Qwen3MoeSparseMoeBlock (top-k
weights renormalised and not), MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock (shared expert), with the
same random weights; bfloat16 parameters against float32; padding tokens with non-finite values; the
parameter layout the loaders fill; the expert-parallel sharding rules and checks. Expert parallelism itself
runs on 4 virtual CPU devices: tests/models/check_moe_expert_parallel.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the flag must be set before JAX starts; this process
keeps its single device)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from jaxserve.config.model_config import ModelConfig
from jaxserve.distributed.sharding import check_tensor_parallel, param_spec
from jaxserve.models.moe import SparseMoeBlock, route
from tests.paths import REPO_ROOT, assert_checks_pass_on_cpu_devices

HIDDEN, INTERMEDIATE, SHARED_INTERMEDIATE = 16, 12, 20


class Case(NamedTuple):
    torch_block: type[torch.nn.Module]
    hf_config: object
    block: SparseMoeBlock


def _block(num_experts: int, top_k: int, norm_topk_prob: bool, shared: int | None = None, dtype=jnp.float32):
    return SparseMoeBlock(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=INTERMEDIATE,
                          norm_topk_prob=norm_topk_prob, hidden_act="silu", dtype=dtype,
                          shared_expert_intermediate_size=shared)


def _qwen3(norm_topk_prob: bool) -> Case:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=5,
                            num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    return Case(Qwen3MoeSparseMoeBlock, config, _block(5, 2, norm_topk_prob))


CASES = {
    "qwen3_moe": _qwen3(norm_topk_prob=True),
    "qwen3_moe_unnormalised": _qwen3(norm_topk_prob=False),
    "mixtral": Case(MixtralSparseMoeBlock, MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                         num_local_experts=7, num_experts_per_tok=3),
                    _block(7, 3, norm_topk_prob=True)),
    "qwen2_moe": Case(Qwen2MoeSparseMoeBlock, Qwen2MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, shared_expert_intermediate_size=SHARED_INTERMEDIATE,
        num_experts=7, num_experts_per_tok=3, norm_topk_prob=False), _block(7, 3, False, SHARED_INTERMEDIATE)),
}


@functools.cache
def _torch_block(name: str) -> torch.nn.Module:
    """The transformers block with random weights; its router sharper than the rest, so that the experts
    get uneven token counts."""
    case = CASES[name]
    torch.manual_seed(0)
    block = case.torch_block(case.hf_config).eval()
    with torch.no_grad():
        for param_name, param in block.named_parameters():
            torch.nn.init.normal_(param, std=1.0 if param_name == "gate.weight" else 0.2)
    return block


def _flax_params(block: torch.nn.Module) -> dict:
    """transformers' weights in the block's layout: kernels `[in, out]`, the fused experts' gate_up_proj
    `[E, 2I, hidden]` split into gate_proj and up_proj `[E, hidden, I]`, down_proj `[E, I, hidden]`."""
    w = {name: p.detach().numpy() for name, p in block.named_parameters()}
    gate_up = w["experts.gate_up_proj"]
    params = {
        "router": {"kernel": w["gate.weight"].T},
        "experts": {
            "gate_proj": gate_up[:, :INTERMEDIATE].transpose(0, 2, 1),
            "up_proj": gate_up[:, INTERMEDIATE:].transpose(0, 2, 1),
            "down_proj": w["experts.down_proj"].transpose(0, 2, 1),
        },
    }
    if "shared_expert_gate.weight" in w:
        params["shared_expert"] = {n: {"kernel": w[f"shared_expert.{n}.weight"].T}
                                   for n in ("gate_proj", "up_proj", "down_proj")}
        params["shared_expert_gate"] = {"kernel": w["shared_expert_gate.weight"].T}
    return {"params": jax.tree.map(jnp.asarray, params)}


def _input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(2, 7, HIDDEN)).astype(np.float32)


def _expert_counts(block: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    _, _, experts = block.gate(torch.from_numpy(x).reshape(-1, HIDDEN))
    return np.bincount(experts.numpy().reshape(-1), minlength=block.gate.num_experts)


@pytest.mark.parametrize("name", CASES)
def test_the_block_equals_transformers(name):
    case, block, x = CASES[name], _torch_block(name), _input()
    with torch.no_grad():
        expected = block(torch.from_numpy(x)).numpy()
    out = jax.jit(case.block.apply)(_flax_params(block), jnp.asarray(x))
    assert out.dtype == jnp.float32 and out.shape == x.shape
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)
    counts = _expert_counts(block, x)
    assert counts.sum() == x.shape[0] * x.shape[1] * case.block.num_experts_per_tok
    assert counts.min() < counts.max(), counts  # the grouped matmuls see groups of different sizes


@pytest.mark.parametrize("name", CASES)
def test_few_tokens_gather_their_experts_and_equal_transformers(name):
    """One or two tokens (k assignments each, no more than the experts): the gathered-weights path."""
    case, block = CASES[name], _torch_block(name)
    for x in (_input(1)[:1, :1], _input(2)[:1, :2]):  # 3 and 6 assignments of 7 experts
        with torch.no_grad():
            expected = block(torch.from_numpy(x)).numpy()
        out = jax.jit(case.block.apply)(_flax_params(block), jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_the_parameters_are_laid_out_as_the_loaders_fill_them(name):
    """The block's own tree (names, shapes, dtype) is the tree transformers' weights convert to."""
    case = CASES[name]
    shapes = jax.eval_shape(case.block.init, jax.random.key(0), jnp.zeros((2, 7, HIDDEN)))
    converted = _flax_params(_torch_block(name))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == jax.tree.map(lambda a: (a.shape, a.dtype), converted)
    bf16 = jax.eval_shape(case.block.clone(dtype=jnp.bfloat16).init, jax.random.key(0), jnp.zeros((2, 7, HIDDEN)))
    assert {a.dtype for a in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_bfloat16_parameters_track_float32():
    """The same bf16-representable weights and input, stored in bfloat16 and in float32: the routing is the
    same, and the only difference is the rounding of the expert's hidden activations before down_proj."""
    case = CASES["qwen2_moe"]
    params_bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _flax_params(_torch_block("qwen2_moe")))
    params_f32 = jax.tree.map(lambda a: a.astype(jnp.float32), params_bf16)
    x = jnp.asarray(_input()).astype(jnp.bfloat16).astype(jnp.float32)
    out = jax.jit(case.block.clone(dtype=jnp.bfloat16).apply)(params_bf16, x)
    expected = np.asarray(jax.jit(case.block.apply)(params_f32, x))
    assert out.dtype == jnp.float32
    error = np.abs(np.asarray(out) - expected).max() / np.abs(expected).max()
    assert 0 < error < 1e-2, error


def test_non_finite_padding_tokens_leave_the_real_tokens_alone():
    case = CASES["qwen2_moe"]
    params, x = _flax_params(_torch_block("qwen2_moe")), jnp.asarray(_input())
    padded = x.at[1, 4].set(jnp.inf).at[1, 5].set(jnp.nan).at[1, 6].set(1e30)
    apply = jax.jit(case.block.apply)
    clean, out = np.asarray(apply(params, x)), np.asarray(apply(params, padded))
    np.testing.assert_allclose(out[0], clean[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(out[1, :4], clean[1, :4], atol=1e-6, rtol=0)


def test_routing_breaks_ties_lowest_expert_first():
    """Among equal probabilities the lowest expert wins. torch.topk leaves the order of ties unspecified (on
    CPU it picks experts 2 and 4 of the three-way tie below); the weights are the same either way."""
    logits = np.array([[0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 0.0, 0.0, 2.0, 0.0]], np.float32)
    weights, experts = route(jnp.asarray(logits), 2, norm_topk_prob=True)
    torch_weights, _ = torch.topk(torch.softmax(torch.from_numpy(logits), dim=-1), 2)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 2], [0, 3]])
    torch_weights = torch_weights / torch_weights.sum(dim=-1, keepdim=True)
    np.testing.assert_allclose(np.asarray(weights), torch_weights.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights), 0.5, rtol=1e-6)


def test_the_experts_are_sharded_on_their_expert_axis_and_the_rest_as_before():
    layer = ("params", "layers", "mlp")
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        assert param_spec((*layer, "experts", leaf), 4) == P(None, "tp", None, None)  # stacked layers
        assert param_spec(("params", "layers", "0", "mlp", "experts", leaf), 3) == P("tp", None, None)
    assert param_spec((*layer, "router", "kernel"), 3) == P()
    assert param_spec((*layer, "shared_expert_gate", "kernel"), 3) == P()
    assert param_spec((*layer, "shared_expert", "gate_proj", "kernel"), 3) == P(None, None, "tp")
    assert param_spec((*layer, "shared_expert", "up_proj", "kernel"), 3) == P(None, None, "tp")
    assert param_spec((*layer, "shared_expert", "down_proj", "kernel"), 3) == P(None, "tp", None)
    assert param_spec((*layer, "down_proj", "kernel"), 3) == P(None, "tp", None)  # the dense MLP's rules


_FIELDS = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=HIDDEN, intermediate_size=32,
               num_layers=2, num_heads=4, num_kv_heads=4, head_dim=4)


def test_check_tensor_parallel_checks_the_experts_not_the_dense_mlp_of_an_moe_model():
    check_tensor_parallel(ModelConfig(**_FIELDS), 4)  # a dense model
    moe = ModelConfig(**{**_FIELDS, "intermediate_size": 30}, num_experts=8, num_experts_per_tok=2)
    check_tensor_parallel(moe, 4)  # the experts are split whole: the unused dense size does not matter
    with pytest.raises(ValueError, match=r"intermediate_size \(30\) is not divisible by tensor_parallel_size"):
        check_tensor_parallel(dataclasses.replace(moe, num_experts=None), 4)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        check_tensor_parallel(dataclasses.replace(moe, num_experts=6), 4)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(10\) is not divisible by .* \(4\)"):
        check_tensor_parallel(dataclasses.replace(moe, shared_expert_intermediate_size=10), 4)


CHECKS = REPO_ROOT / "tests" / "models" / "check_moe_expert_parallel.py"
NUM_CHECKS = 8


def test_expert_parallel_checks_pass_on_4_cpu_devices():
    """Meshes of 1, 2 and 4 devices give the unsharded outputs (E = 8, with and without a shared expert),
    each device holds E / tp experts, the tp-2 block communicates exactly one all-reduce, non-finite padding
    stays in its rows, and E = 6 at tp 4 is refused."""
    assert_checks_pass_on_cpu_devices(CHECKS, 4, NUM_CHECKS, timeout=300)
