"""DeepSeek-V2 / V3 and Kimi K2 beyond the families' parity tests (tests/models/test_families.py and
test_family_engines.py): the latent attention's config and its pool of latents, DeepSeek's routing on scores whose
answer is known, int8 weights, and what is refused."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.compilation.sizing import _block_bytes
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.mla_config import MLAConfig
from jaxserve.config.model_config import ModelConfig
from jaxserve.distributed.sharding import check_tensor_parallel
from jaxserve.models.deepseek import deepseek_route
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import FAMILY_TOKENS, TINY_FAMILIES, make_tiny_model, tiny_hf_config
from jaxserve.weights import load_model
from tests.forward import PagedForward


def config_of(name: str, **overrides) -> ModelConfig:
    family, defaults = TINY_FAMILIES[name]
    hf = tiny_hf_config(family, **{**defaults, **overrides}).to_dict()
    architecture = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}[family]
    return ModelConfig.from_hf({**hf, "architectures": [architecture]})


def test_the_config_reads_the_latent_attention_and_its_routing():
    cfg = config_of("deepseek-v3")
    mla = cfg.mla
    assert (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.q_lora_rank) == (
        20, 12, 8, 16, 24)
    assert (mla.routing, mla.n_group, mla.topk_group, mla.n_shared_experts, mla.correction_bias) == (
        "noaux_tc", 4, 2, 1, True)
    assert mla.softmax_scale == pytest.approx(20**-0.5 * (0.1 * 0.8 * math.log(4) + 1) ** 2)
    # the pool: one kv head of the latent and the rotary key, keys only
    assert (cfg.kv_page_shapes, cfg.kv_values_in_keys, cfg.sparse_layers) == (((1, 28),), True, (False, True, True))
    v2 = config_of("deepseek-v2-lite").mla
    assert (v2.q_lora_rank, v2.routing, v2.correction_bias, v2.n_shared_experts) == (None, "greedy", False, 2)
    assert config_of("deepseek-v2-lite").norm_topk_prob is False  # V2 never renormalises


def test_an_int8_kv_cache_is_refused_for_a_pool_of_latents():
    with pytest.raises(ValueError, match="kv_cache_dtype int8 keeps no latent \\(MLA\\) pool: use auto or fp8"):
        ModelRunner(config_of("deepseek-v3"), {"params": {}}, dtype="float32", block_size=16, num_blocks=10,
                    max_rows=2, abstract=True, attention_backend="cpu", kv_cache_dtype="int8")


def test_the_pool_keeps_the_latent_and_the_rotary_key_per_token_and_layer_only():
    cfg = config_of("deepseek-v3")
    params = {"params": {}}  # the pool's shapes do not read the weights
    runner = ModelRunner(cfg, params, dtype="float32", block_size=16, num_blocks=10, max_rows=2, abstract=True,
                         attention_backend="cpu")
    keys, values = runner.kv_pool
    assert keys.shape == (3, 1, 10, 16, 20 + 8) and values.shape == (3, 1, 10, 16, 0)
    one_device, four_devices = (type("Mesh", (), {"size": size})() for size in (1, 4))
    assert _block_bytes(cfg, 16, "bfloat16", one_device, 64) == 3 * 16 * 28 * 2  # 3 layers, no V
    assert _block_bytes(cfg, 16, "bfloat16", four_devices, 64) == 3 * 16 * 28 * 2  # whole on every device


def scores_to_logits(scores) -> jnp.ndarray:
    scores = np.asarray([scores], np.float32)
    return jnp.asarray(np.log(scores / (1 - scores)))  # sigmoid(logit) = score


def test_v3_routing_keeps_the_groups_of_the_best_two_scores_and_weighs_by_the_unbiased_scores():
    """8 experts in 4 groups of 2, the best 2 groups, top 2: expert 0 scores best but its group (0.9 + 0.1) loses to
    groups 1 (1.2) and 2 (1.1). The correction bias moves expert 4 up for selection only."""
    mla = MLAConfig(8, 8, 8, 8, routing="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.0)
    logits = scores_to_logits([0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2])
    weights, experts = deepseek_route(logits, jnp.zeros(8), mla, 2, True)
    assert experts.tolist() == [[2, 3]] and np.allclose(weights, [[1.0, 1.0]])
    bias = jnp.zeros(8).at[4].set(0.3)
    weights, experts = deepseek_route(logits, bias, mla, 2, True)
    assert experts.tolist() == [[4, 2]] and np.allclose(weights, [[2 * 0.55 / 1.15, 2 * 0.6 / 1.15]])


def test_v2_routing_by_softmax_greedy_or_limited_to_the_groups_of_the_best_experts():
    probs = np.asarray([0.3, 0.05, 0.2, 0.15, 0.1, 0.2], np.float32)
    logits = jnp.asarray(np.log(probs))[None]
    greedy = MLAConfig(8, 8, 8, 8, routing="greedy", correction_bias=False)
    weights, experts = deepseek_route(logits, None, greedy, 2, False)
    assert experts.tolist() == [[0, 2]] and np.allclose(weights, [[0.3, 0.2]])  # not renormalised
    limited = MLAConfig(8, 8, 8, 8, routing="group_limited_greedy", n_group=3, topk_group=1, correction_bias=False)
    weights, experts = deepseek_route(logits, None, limited, 2, False)
    assert experts.tolist() == [[0, 1]] and np.allclose(weights, [[0.3, 0.05]])  # group 0 (best expert 0.3) only


def test_int8_weights_quantize_projections_mlps_and_experts_and_track_float(tmp_path):
    family, overrides = TINY_FAMILIES["deepseek-v3"]
    path = make_tiny_model(tmp_path / "m", family, **overrides)
    loaded = load_model(str(path), "float32")
    cfg, params = apply_quantization(loaded.config, loaded.params, "int8")
    layers = params["params"]["layers"]
    assert layers["0"]["self_attn"]["o_proj"]["kernel"].dtype == np.int8 and "kernel_scale" in layers["0"]["mlp"][
        "up_proj"]
    assert layers["1"]["mlp"]["experts"]["down_proj"].dtype == np.int8
    assert "kernel_scale" not in layers["1"]["self_attn"]["kv_b_proj"]  # the latent projections stay float
    expected = hf_logits(path, FAMILY_TOKENS)
    got = PagedForward(cfg, params, backend="cpu", scan_layers=False).run(FAMILY_TOKENS, [3, 0, 5, 1], [7, 9])
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_what_the_engine_cannot_serve_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) is not divisible by n_group \(3\)"):
        config_of("deepseek-v3", n_group=3)
    check_tensor_parallel(config_of("deepseek-v3"), 2)  # one latent kv head: the pool is whole on every device
    with pytest.raises(ValueError, match=r"num_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        check_tensor_parallel(config_of("deepseek-v3"), 3)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        check_tensor_parallel(config_of("deepseek-v2-lite", intermediate_size=96), 4)
    with pytest.raises(ValueError, match="unsupported DeepSeek topk_method 'random'"):
        config_of("deepseek-v2-lite", topk_method="random")


LATENT_KERNEL_SHAPE = dict(kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
                           num_hidden_layers=2, hidden_size=64, n_routed_experts=4, n_group=2)


def test_the_latent_kernel_decodes_as_transformers(tmp_path):
    """The Pallas latent kernel (interpreted) serves the decode steps of a model whose latent it takes (rank 128,
    rotary 64) in the TPU engine's rows, padded with zeros to 256 lanes (`EngineConfig.kv_cache_model_config`; the
    kernel's own tests take unpadded rows too); the prompt's chunk attends in the expanded form."""
    path = make_tiny_model(tmp_path / "m", "deepseek_v3", **LATENT_KERNEL_SHAPE)
    loaded = load_model(str(path), "float32")
    assert EngineConfig().kv_cache_model_config(loaded.config, "cpu").kv_page_shapes == ((1, 192),)
    cfg = EngineConfig().kv_cache_model_config(loaded.config, "tpu")
    assert cfg.kv_page_shapes == ((1, 256),)
    forward = PagedForward(cfg, loaded.params, backend="pallas", block_size=16, num_blocks=4)
    got = forward.run(FAMILY_TOKENS[:9], [2, 0], [6, 1, 1, 1])
    np.testing.assert_allclose(got, hf_logits(path, FAMILY_TOKENS[:9]), atol=2e-5, rtol=0)


def test_prefill_chunks_attend_in_the_absorbed_form_on_request_as_transformers(tmp_path):
    """Prefill steps attend in the expanded form by default (`models/mla_expanded.py`, which every family parity test
    runs); the absorbed form, which decode and mixed steps use, gives the same logits for them."""
    family, overrides = TINY_FAMILIES["deepseek-v3"]
    path = make_tiny_model(tmp_path / "m", family, **overrides)
    loaded = load_model(str(path), "float32")
    cfg = dataclasses.replace(loaded.config, mla=dataclasses.replace(loaded.config.mla, prefill_form="absorbed"))
    got = PagedForward(cfg, loaded.params).run(FAMILY_TOKENS, [3, 0, 5, 1, 2], [6, 5, 1, 4])
    np.testing.assert_allclose(got, hf_logits(path, FAMILY_TOKENS), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"prefill_form must be one of \('expanded', 'absorbed'\), got 'dense'"):
        dataclasses.replace(loaded.config.mla, prefill_form="dense")
