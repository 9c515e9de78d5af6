"""Gemma 4 beyond the families' parity tests (tests/models/test_families.py, test_family_engines.py): its config in
both of transformers' forms, the multimodal checkpoint's text decoder, what is refused, the pool's two page shapes
(in the Pallas kernels' layouts too) and the KV-sharing layers' missing projections."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.compilation.sizing import _block_bytes
from jaxserve.config.model_config import ModelConfig
from jaxserve.distributed.sharding import check_tensor_parallel
from jaxserve.quantization.weights import apply_quantization
from jaxserve.runner.model_runner import copy_pool_blocks
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import FAMILY_TOKENS, TINY_FAMILIES, make_tiny_model, tiny_hf_config
from jaxserve.weights import load_model
from tests.forward import PagedForward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family, overrides = TINY_FAMILIES["gemma4"]
    return make_tiny_model(tmp_path_factory.mktemp("gemma4"), family, **overrides)


def saved_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_config_reads_per_layer_shapes_kv_sharing_and_the_extra_blocks(tiny):
    cfg = ModelConfig.from_hf(saved_config(tiny))
    layers = cfg.gemma4
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.sliding_window) == (24, 2, 5)
    assert layers.head_dims == (24, 24, 48, 24, 24, 24, 48) and layers.kv_heads == (2, 2, 1, 2, 2, 2, 1)
    assert layers.k_eq_v == (False, False, True, False, False, False, True)
    assert layers.kv_sources == (0, 1, 2, 3, 3, 3, 2)  # the last three read the last earlier layer of their type
    assert layers.intermediate_sizes == (128,) * 4 + (256,) * 3  # double-wide MLPs on the sharing layers
    assert (layers.per_layer_input_size, layers.num_experts, layers.top_k_experts) == (12, 5, 2)
    assert (layers.full_rope_theta, layers.full_partial_rotary_factor) == (10000.0, 0.25)
    assert cfg.kv_page_shapes == ((2, 24), (1, 48))


def test_the_arguments_transformers_turns_into_per_layer_config_read_the_same(tiny):
    """A config written by hand (global_head_dim, num_global_key_value_heads) instead of a saved one."""
    hf = saved_config(tiny)
    del hf["per_layer_config"]
    hf.update(global_head_dim=48, num_global_key_value_heads=1)
    assert ModelConfig.from_hf(hf).gemma4 == ModelConfig.from_hf(saved_config(tiny)).gemma4
    hf["attention_k_eq_v"] = False  # transformers applies the kv heads only with attention_k_eq_v
    assert ModelConfig.from_hf(hf).gemma4.kv_heads == (2,) * 7


def test_what_the_engine_cannot_serve_is_refused_with_the_reason(tiny):
    hf = saved_config(tiny)
    with pytest.raises(ValueError, match="use_bidirectional_attention='all' attends to later tokens"):
        ModelConfig.from_hf({**hf, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match=r"num_kv_shared_layers \(7\) leaves no layer computing K/V"):
        ModelConfig.from_hf({**hf, "num_kv_shared_layers": 7})
    only_sliding_first = {**hf, "num_kv_shared_layers": 5}  # layers 0-1 compute K/V: no full layer among them
    with pytest.raises(ValueError, match=r"KV-shared layers of type \['full_attention'\] have no earlier layer"):
        ModelConfig.from_hf(only_sliding_first)
    with pytest.raises(ValueError, match="Gemma 4 is served on one device per replica"):
        check_tensor_parallel(ModelConfig.from_hf(hf), 2)


def test_the_multimodal_checkpoints_text_decoder_equals_transformers(tiny, tmp_path):
    """`Gemma4ForConditionalGeneration` keeps the text weights under `model.language_model.` and the text config
    in `text_config`: the same decoder, the same logits."""
    for file in tiny.glob("tokenizer*"):
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tiny / "model.safetensors")
    save_file({name.replace("model.", "model.language_model.", 1): value for name, value in tensors.items()},
              tmp_path / "model.safetensors")
    text = saved_config(tiny)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": {key: value for key, value in text.items() if key != "architectures"},
    }))
    loaded = load_model(str(tmp_path), "float32")
    got = PagedForward(loaded.config, loaded.params, backend="cpu").run(FAMILY_TOKENS, [3, 0, 5, 1], [7, 9])
    np.testing.assert_allclose(got, hf_logits(tiny, FAMILY_TOKENS), atol=2e-5, rtol=0)


def test_sharing_layers_have_no_kv_projections_and_full_layers_whose_v_is_k_no_v_proj(tiny):
    loaded = load_model(str(tiny), "float32")
    layers = loaded.params["params"]["layers"]
    assert "k_proj" in layers["3"]["self_attn"] and "v_proj" in layers["3"]["self_attn"]
    assert "k_proj" in layers["2"]["self_attn"] and "v_proj" not in layers["2"]["self_attn"]  # V is K
    assert set(layers["4"]["self_attn"]) == {"q_proj", "q_norm", "o_proj"}  # reads layer 3's cache
    assert loaded.config.kv_page_shapes == ((2, 24), (1, 48))


def test_the_block_ids_go_to_each_page_shape_as_a_request_of_max_model_len_holds_them():
    """Gemma 4 "dense" (sliding, sliding, full; kv heads 2 of head_dim 24 and 48): a request of 64 tokens holds 4
    blocks of 16 in the full group and 2 in each sliding one, so the ids are shared 4 : 4 and a block's mean bytes
    are the mean of a sliding page (K and V, 16 tokens, float32, one layer) and a full one."""
    hf = tiny_hf_config("gemma4", **TINY_FAMILIES["gemma4-dense"][1]).to_dict()
    cfg = ModelConfig.from_hf({**hf, "architectures": ["Gemma4ForCausalLM"]})
    layout = cfg.kv_cache_layout
    assert layout.group_kinds == (1, 0, 0) and layout.kind_demand(64, 16) == (4, 4)
    # a block in flight for each sliding group's chunk, the other 99 shared 4 : 4, the odd one to the largest
    assert layout.blocks_of_kinds(101, 64, 16) == (2 + 49 + 1, 49)
    mesh = type("OneDevice", (), {"size": 1})()
    sliding, full = 2 * 2 * 16 * 24 * 4, 2 * 2 * 16 * 48 * 4
    assert _block_bytes(cfg, 16, "float32", mesh, 64) == (sliding + full) // 2


def test_a_gemma4_without_a_second_page_shape_has_one_pool(tmp_path):
    """Full layers of the sliding layers' head_dim and kv heads: one kind, the plain (K, V) pool."""
    config = tiny_hf_config("gemma4", global_head_dim=24, attention_k_eq_v=False)
    cfg = ModelConfig.from_hf(config.to_dict() | {"architectures": ["Gemma4ForCausalLM"]})
    assert cfg.kv_page_shapes == ((2, 24),) and cfg.kv_cache_layout.num_kinds == 1


def test_the_pallas_kernels_serve_both_page_shapes(tmp_path):
    """Sliding layers of head_dim 64 and full ones of 128 (layouts the TPU kernels take), interpreted: a prompt chunk
    across the window, then decode steps; the sharing layers read their sources' pages through the same kernels.
    Hidden size 128: transformers' own float32 sums differ by more than at 64, so the bound is relative."""
    family, overrides = TINY_FAMILIES["gemma4"]
    path = make_tiny_model(tmp_path / "m", family, **overrides, hidden_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, global_head_dim=128)
    loaded = load_model(str(path), "float32")
    got = PagedForward(loaded.config, loaded.params, block_size=16, num_blocks=4, backend="pallas").run(
        FAMILY_TOKENS, [2, 0], [12, 1, 1, 1, 1])
    expected = hf_logits(path, FAMILY_TOKENS)
    assert np.abs(got - expected).max() < 5e-5 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_int8_weights_quantize_attention_mlps_and_the_experts_beside_them(tiny, tmp_path):
    """vLLM's int8 (weights per channel): the layer's projections, its dense MLP and its experts (which sit beside
    the attention in a Gemma 4 layer, not in an MLP block); the router, the per-layer input projections, norms and
    embeddings stay float. Logits stay near float32's (without experts, whose routing flips near ties)."""
    loaded = load_model(str(tiny), "float32")
    _, params = apply_quantization(loaded.config, loaded.params, "int8")
    layer = params["params"]["layers"]["0"]
    assert layer["self_attn"]["q_proj"]["kernel"].dtype == np.int8 and "kernel_scale" in layer["mlp"]["up_proj"]
    assert layer["experts"]["gate_proj"].dtype == np.int8 and layer["experts"]["gate_proj_scale"].shape == (5, 40)
    assert "kernel_scale" not in layer["router"]["proj"] and "kernel_scale" not in layer["per_layer_input_gate"]
    family, overrides = TINY_FAMILIES["gemma4-dense"]
    dense = make_tiny_model(tmp_path / "dense", family, **overrides)
    loaded = load_model(str(dense), "float32")
    cfg, params = apply_quantization(loaded.config, loaded.params, "int8")
    expected = hf_logits(dense, FAMILY_TOKENS)
    got = PagedForward(cfg, params, backend="cpu").run(FAMILY_TOKENS, [3, 0, 5, 1], [7, 9])
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_copy_on_write_copies_each_pair_in_the_kind_of_page_its_ids_are():
    """Ids 0-2 are the first kind's blocks 0-2, ids 3-4 the second kind's 0-1; a padding pair (dst 5) is dropped."""
    first = jnp.arange(3, dtype=jnp.float32).reshape(1, 1, 3, 1, 1) * jnp.ones((1, 2, 3, 4, 8))
    second = (10 + jnp.arange(2, dtype=jnp.float32)).reshape(1, 1, 2, 1, 1) * jnp.ones((1, 1, 2, 4, 16))
    pool = ((first, first), (second, second))
    (k_first, _), (k_second, _) = copy_pool_blocks(pool, jnp.array([4, 0, 0]), jnp.array([3, 2, 5]), (3, 2))
    assert [float(k_first[0, 0, b, 0, 0]) for b in range(3)] == [0.0, 1.0, 0.0]
    assert [float(k_second[0, 0, b, 0, 0]) for b in range(2)] == [11.0, 11.0]
