"""OPT and GPT-2: config reading, logits parity with transformers on tiny random models of each variant
(pre- and post-norm OPT with projections, no-bias OPT, GPT-2 with its options), hub checkpoints without
the wrapper prefix, and greedy generation through the engine equal to transformers' `generate`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from jaxserve import LLM, SamplingParams
from jaxserve.config.model_config import ModelConfig
from jaxserve.testing.hf_reference import hf_greedy, hf_logits
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from tests.forward import PagedForward

TOKENS = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64, 7, 31]

VARIANTS = {
    "opt-pre-norm-tied": ("opt", {}),
    "opt-post-norm-projected": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-no-affine-untied": (
        "opt", {"enable_bias": False, "layer_norm_elementwise_affine": False, "tie_word_embeddings": False},
    ),
    "gpt2-tied": ("gpt2", {}),
    "gpt2-layer-scaled-untied": (
        "gpt2", {"scale_attn_by_inverse_layer_idx": True, "n_inner": 96, "activation_function": "gelu",
                 "tie_word_embeddings": False},
    ),
}

# (pre_norm, final_norm, word_embed_proj_dim, hidden_act, tie, attention_bias, intermediate_size, eps, layer-scaled)
EXPECTED_CONFIG = {
    "opt-pre-norm-tied": (True, True, None, "relu", True, True, 128, 1e-5, False),
    "opt-post-norm-projected": (False, False, 32, "relu", True, True, 128, 1e-5, False),
    "opt-no-bias-no-affine-untied": (True, True, None, "relu", False, False, 128, 1e-5, False),
    "gpt2-tied": (True, True, None, "gelu_new", True, True, 256, 1e-5, False),
    "gpt2-layer-scaled-untied": (True, True, None, "gelu", False, True, 96, 1e-5, True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return request.param, path, load_model(str(path), "float32")


def test_config_reads_variant_features(tiny):
    name, _, loaded = tiny
    cfg = loaded.config
    got = (cfg.pre_norm, cfg.final_norm, cfg.word_embed_proj_dim, cfg.hidden_act, cfg.tie_word_embeddings,
           cfg.attention_bias, cfg.intermediate_size, cfg.layer_norm_eps, cfg.scale_attn_by_inverse_layer_idx)
    assert got == EXPECTED_CONFIG[name]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (4, 4, 16, 512)
    assert not cfg.uses_rope


def test_prefill_logits_match_transformers(tiny):
    _, path, loaded = tiny
    expected = hf_logits(path, TOKENS)
    got = PagedForward(loaded.config, loaded.params).run(TOKENS, [0, 1, 2, 3], [len(TOKENS)])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    assert np.abs(expected).max() > 1.0


def test_chunks_and_decode_steps_over_scattered_blocks_match_transformers(tiny):
    _, path, loaded = tiny
    expected = hf_logits(path, TOKENS)
    got = PagedForward(loaded.config, loaded.params).run(TOKENS, [9, 2, 30, 17], [6, 6, 1, 1])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize(("family", "prefix"), [("gpt2", "transformer."), ("opt", "model.")])
def test_hub_checkpoint_without_wrapper_prefix_loads_the_same(tmp_path, family, prefix):
    """openai-community/gpt2 stores `h.0.attn...`, facebook/opt-* `decoder.layers...`: both spellings load."""
    from safetensors.numpy import load_file, save_file

    path = make_tiny_model(tmp_path / "m", family)
    reference = load_model(str(path)).params
    tensors = load_file(path / "model.safetensors")
    assert all(name.startswith(prefix) for name in tensors)
    save_file({n[len(prefix):]: t for n, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    stripped = flatten_dict(load_model(str(path)).params)
    reference = flatten_dict(reference)
    assert stripped.keys() == reference.keys()
    for key, value in reference.items():
        np.testing.assert_array_equal(stripped[key], value)


def test_gpt2_c_attn_is_split_into_q_k_v(tmp_path):
    from safetensors.numpy import load_file

    path = make_tiny_model(tmp_path / "m", "gpt2")
    c_attn = load_file(path / "model.safetensors")["transformer.h.1.attn.c_attn.weight"]  # [in, 3 * hidden]
    attn = load_model(str(path)).params["params"]["layers"]["self_attn"]
    np.testing.assert_array_equal(attn["k_proj"]["kernel"][1], c_attn[:, 64:128])
    assert attn["q_proj"]["kernel"].shape == (2, 64, 64)


def test_gpt2_cross_attention_is_refused():
    with pytest.raises(ValueError, match=r"GPT-2 models with cross-attention \(add_cross_attention=true\)"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "add_cross_attention": True})


def test_opt_125m_config_json():
    """facebook/opt-125m's config.json as published (no tie_word_embeddings or enable_bias keys)."""
    hf = json.loads(
        '{"activation_function": "relu", "architectures": ["OPTForCausalLM"], "bos_token_id": 2, '
        '"do_layer_norm_before": true, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, '
        '"init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt", '
        '"num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "vocab_size": 50272, '
        '"word_embed_proj_dim": 768}'
    )
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.intermediate_size) == ("opt", 12, 12, 64, 3072)
    assert cfg.tie_word_embeddings and cfg.attention_bias and cfg.mlp_bias and cfg.final_norm
    assert cfg.word_embed_proj_dim is None and cfg.eos_token_id == (2,)


@pytest.mark.parametrize("variant", ["opt-post-norm-projected", "gpt2-tied"])
def test_engine_greedy_tokens_equal_transformers_generate(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    path = make_tiny_model(tmp_path / "m", family, seed=3, **overrides)
    prompts = [TOKENS, [1, 5, 9, 250, 33], list(range(3, 40))]
    llm = LLM(str(path), dtype="float32", buckets=small_bucket_file(tmp_path), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, 12) for p in prompts]
