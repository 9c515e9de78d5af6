"""The families beyond Llama on tiny random transformers models: Qwen3, Phi-3, Gemma 2 and 3, Mixtral, Qwen2-MoE
and Qwen3-MoE. Their config fields are read, and float32 logits over the paged pool equal transformers' within
2e-5 on a prompt three times longer than the sliding window, prefilled whole, in chunks over scattered blocks
and token by token, scanned (and unrolled for three of them), on the reference and cpu attention backends
(Pallas: in the engine tests).
The engine's greedy tokens are in tests/models/test_family_engines.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxserve.models.common import attention_scale
from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import FAMILY_TOKENS as TOKENS
from jaxserve.testing.tiny_models import TINY_FAMILIES as FAMILIES
from jaxserve.testing.tiny_models import longrope_overrides, make_tiny_model
from jaxserve.weights import load_model
from tests.forward import PagedForward

# family, head_dim, rotary_dim, sliding layers, qk_norm, attention scale, softcaps, experts (E, k, normalised)
EXPECTED_CONFIG = {
    "qwen3-gqa": ("qwen3", 24, 24, (False,) * 2, True, 24**-0.5, (None, None), (None, 0, True)),
    "qwen3-mha-tied": ("qwen3", 24, 24, (False,) * 2, True, 24**-0.5, (None, None), (None, 0, True)),
    "phi3-partial-rotary": ("phi3", 16, 8, (False,) * 2, False, 0.25, (None, None), (None, 0, True)),
    "phi3-sliding-window": ("phi3", 16, 16, (True,) * 2, False, 0.25, (None, None), (None, 0, True)),
    "gemma2-softcaps": ("gemma2", 16, 16, (True, False), False, 0.25, (5.0, 3.0), (None, 0, True)),
    "gemma3-local-rope": ("gemma3", 24, 24, (True, False, True), True, 20**-0.5, (None, None), (None, 0, True)),
    "gemma3-mha-tied": ("gemma3", 24, 24, (True,) * 5 + (False, True), True, 20**-0.5, (None, None),
                        (None, 0, True)),
    "mixtral": ("mixtral", 16, 16, (True,) * 2, False, 0.25, (None, None), (5, 2, True)),
    "qwen3-moe": ("qwen3_moe", 16, 16, (False,) * 2, True, 0.25, (None, None), (7, 3, True)),
    "qwen3-moe-unnormalised": ("qwen3_moe", 16, 16, (False,) * 2, True, 0.25, (None, None), (5, 2, False)),
    "qwen2-moe-shared-expert": ("qwen2_moe", 16, 16, (False,) * 2, False, 0.25, (None, None), (5, 2, False)),
    "qwen3-moe-mlp-only-layers": ("qwen3_moe", 16, 16, (False,) * 4, True, 0.25, (None, None), (7, 3, True)),
    "qwen2-moe-sparse-step": ("qwen2_moe", 16, 16, (False,) * 3, False, 0.25, (None, None), (5, 2, False)),
    "gpt-oss": ("gpt_oss", 24, 24, (True, False), False, 24**-0.5, (None, None), (5, 2, True)),
    "gemma4": ("gemma4", 24, 24, (True,) * 2 + (False,) + (True,) * 3 + (False,), True, 1.0, (None, 30.0),
               (None, 0, True)),
    "gemma4-dense": ("gemma4", 24, 24, (True, True, False), True, 1.0, (None, 30.0), (None, 0, True)),
    # the pool's page is the latent (20 + 8), the rotary part 8; scale qk_head_dim^-0.5 * YaRN's mscale^2
    "deepseek-v3": ("deepseek_v3", 28, 8, (False,) * 3, False, 20**-0.5 * (0.08 * math.log(4) + 1) ** 2,
                    (None, None), (8, 3, True)),
    "kimi-k2": ("deepseek_v3", 28, 8, (False,) * 3, False, 24**-0.5 * (0.1 * math.log(8) + 1) ** 2, (None, None),
                (7, 2, True)),
    "deepseek-v2-lite": ("deepseek_v2", 28, 8, (False,) * 3, False, 20**-0.5 * (0.0707 * math.log(4) + 1) ** 2,
                         (None, None), (6, 2, False)),
    "deepseek-v2-group-limited": ("deepseek_v2", 28, 8, (False,) * 3, False,
                                  20**-0.5 * (0.0707 * math.log(4) + 1) ** 2, (None, None), (6, 2, False)),
    "llama-attention-bias": ("llama", 16, 16, (False,) * 2, False, 0.25, (None, None), (None, 0, True)),
}
MIXED_MLP_LAYERS = {  # which layers are sparse
    "qwen3-moe-mlp-only-layers": (False, True, False, True),
    "qwen2-moe-sparse-step": (False, True, False),
    "deepseek-v3": (False, True, True),  # first_k_dense_replace 1
    "deepseek-v2-lite": (False, True, True),
    "kimi-k2": (False, True, True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return request.param, path, load_model(str(path), "float32"), hf_logits(path, TOKENS)


def test_config_reads_family_features(tiny):
    name, _, loaded, _ = tiny
    cfg = loaded.config
    got = (
        cfg.family, cfg.head_dim, cfg.rotary_dim, cfg.sliding_layers, cfg.qk_norm, attention_scale(cfg),
        (cfg.attn_logit_softcap, cfg.final_logit_softcap),
        (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob),
    )
    expected = EXPECTED_CONFIG[name]
    assert got[:5] == expected[:5] and got[6:] == expected[6:]
    assert got[5] == pytest.approx(expected[5])
    assert cfg.mixes_mlp_kinds is (name in MIXED_MLP_LAYERS)


def test_a_config_of_layer_types_the_engine_cannot_serve_is_refused_at_load(tmp_path):
    """Qwen3.5's linear-attention layers (not served yet) are not taken for full attention; a window that is not a
    positive number of tokens is refused."""
    import json

    path = make_tiny_model(tmp_path, "qwen3", layer_types=["full_attention", "full_attention"])
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "full_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^unsupported layer types \['linear_attention'\]: the engine serves "
                                         r"sliding_attention, full_attention$"):
        load_model(str(path), "float32")
    config.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)
    for window in (0, -4, 2.5):
        config["sliding_window"] = window
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=rf"^sliding_window must be a positive number of tokens, got {window}$"):
            load_model(str(path), "float32")


@pytest.mark.parametrize("name", sorted(MIXED_MLP_LAYERS))
def test_mixed_dense_and_moe_layers_load_one_subtree_per_layer(name, tmp_path):
    """Their MLPs do not stack, so each layer has its own parameters: the experts where the layer is sparse
    (transformers' rule: not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0), a dense MLP elsewhere."""
    family, overrides = FAMILIES[name]
    loaded = load_model(str(make_tiny_model(tmp_path, family, **overrides)), "float32")
    assert loaded.config.sparse_layers == MIXED_MLP_LAYERS[name]
    layers = loaded.params["params"]["layers"]
    assert sorted(layers) == [str(i) for i in range(loaded.config.num_layers)]
    kinds = tuple("experts" in layers[str(i)]["mlp"] for i in range(loaded.config.num_layers))
    assert kinds == MIXED_MLP_LAYERS[name]
    dense = layers["0"]["mlp"]
    assert sorted(dense) == ["down_proj", "gate_proj", "up_proj"] and dense["up_proj"]["kernel"].shape == (64, 128)
    assert layers["1"]["mlp"]["experts"]["up_proj"].shape == (loaded.config.num_experts, 64,
                                                             loaded.config.moe_intermediate_size)


def test_prefill_logits_match_transformers(tiny):
    _, _, loaded, expected = tiny
    got = PagedForward(loaded.config, loaded.params).run(TOKENS, [0, 1, 2, 3], [len(TOKENS)])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("name", ["gemma3-local-rope", "phi3-partial-rotary", "qwen3-moe"])
def test_unrolled_layers_match_transformers(name, tmp_path):
    """The unrolled stack (the CPU bfloat16 layout) runs the same layer code: three families cover it."""
    family, overrides = FAMILIES[name]
    path = make_tiny_model(tmp_path / name, family, **overrides)
    loaded = load_model(str(path), "float32")
    got = PagedForward(loaded.config, loaded.params, scan_layers=False).run(TOKENS, [0, 1, 2, 3], [len(TOKENS)])
    np.testing.assert_allclose(got, hf_logits(path, TOKENS), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("backend", "marker", "per_step"), [
    ("cpu", "jaxserve_paged_attention", 1),  # the kernel's custom call, in the layer scan's body
    ("reference", "stablehlo.while", 2),  # the layer scan and the body's one loop over chunks of pages
    ("pallas", "func.func private @paged_attention", 1),  # the decode kernel's function (interpreted on CPU)
])
def test_a_model_of_sliding_and_full_layers_attends_once_per_layer(backend, marker, per_step, tmp_path):
    """Gemma 3's sliding and full layers share one scan body: its layer's window is an operand of the attention
    (0 for a full layer), not two attentions and a select."""
    family, overrides = FAMILIES["gemma3-local-rope"]
    # head_dim 64 and pages of 16 tokens: a layout the Pallas kernels take
    loaded = load_model(str(make_tiny_model(tmp_path, family, **overrides, head_dim=64)), "float32")
    assert set(loaded.config.sliding_layers) == {True, False}
    forward = PagedForward(loaded.config, loaded.params, backend=backend, block_size=16)
    assert forward.lowered_decode_step([0, 1, 2, 3], 40).count(marker) == per_step


def test_chunks_and_decode_steps_over_scattered_blocks_match_transformers(tiny):
    """On the cpu backend (the CPU default; the whole-prompt test above runs the reference backend)."""
    _, _, loaded, expected = tiny
    chunks = [6, 6, 1, 1, 1, 1]  # prefill chunks crossing the window, then decode steps
    got = PagedForward(loaded.config, loaded.params, backend="cpu").run(TOKENS, [9, 2, 30, 17], chunks)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


def test_bfloat16_tracks_float32(tiny):
    """bfloat16 weights and pool (dtype auto on a bf16 matrix unit) stay near transformers' float32 logits. A MoE
    token near a routing tie may take another expert in bfloat16: a step, not drift, so a wider bound there."""
    _, path, _, expected = tiny
    loaded = load_model(str(path), "bfloat16")
    got = PagedForward(loaded.config, loaded.params, dtype="bfloat16").run(TOKENS, [0, 1, 2, 3], [8, 8])
    gemma4_experts = loaded.config.gemma4 is not None and loaded.config.gemma4.num_experts
    bound = 0.05 if loaded.config.num_experts is None and not gemma4_experts else 0.1
    assert np.abs(got - expected).max() < bound * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("long_context", [False, True], ids=["short-factors", "long-factors"])
def test_longrope_matches_transformers(long_context, tmp_path):
    """Phi-3 / Phi-4-mini LongRoPE (pretrained on 8 positions, extended to 32; partial rotary, 4 frequencies). The
    engine picks the factors from its max_model_len; transformers from the sequence's length, so a prompt
    within the original 8 positions takes the short factors there and a longer one the long factors."""
    path = make_tiny_model(tmp_path, "phi3", max_position_embeddings=32, **longrope_overrides(4, 8))
    loaded = load_model(str(path), "float32")
    assert loaded.config.rope.attention_factor == pytest.approx((1 + np.log(4) / np.log(8)) ** 0.5)
    config = loaded.config.for_max_model_len(32 if long_context else 8)
    assert config.rope.long_context is long_context
    tokens, chunks = (TOKENS, [6, 6, 1, 1, 1, 1]) if long_context else (TOKENS[:8], [5, 1, 1, 1])
    expected = hf_logits(path, tokens)
    got = PagedForward(config, loaded.params, backend="cpu").run(tokens, [9, 2, 30, 17], chunks)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    other = loaded.config.for_max_model_len(8 if long_context else 32)  # the other factors differ visibly
    assert np.abs(PagedForward(other, loaded.params).run(tokens, [0, 1, 2, 3], [len(tokens)]) - expected).max() > 0.1


def test_longrope_factors_must_cover_the_rotary_dimension(tmp_path):
    from jaxserve.config.model_config import ModelConfig

    hf = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 4, "partial_rotary_factor": 0.5,
          "max_position_embeddings": 32, **longrope_overrides(3, 8)}
    with pytest.raises(ValueError, match="rope short_factor has 3 entries; the rotary dimension 8 needs 4"):
        ModelConfig.from_hf(hf)
    hf["rope_scaling"] = {"type": "su", "short_factor": [1.0] * 4}
    with pytest.raises(ValueError, match="longrope scaling needs both short_factor and long_factor"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 6, "beta_fast": 8.0, "beta_slow": 2.0,
     "mscale": 0.7, "mscale_all_dim": 1.0},
], ids=["yarn", "yarn-betas-mscales"])
def test_yarn_matches_transformers(scaling, tmp_path):
    """YaRN (Qwen3's long-context setting, DeepSeek's mscales): frequencies interpolated by a ramp between the
    beta bounds over a short original context, cos and sin scaled by the attention factor."""
    path = make_tiny_model(tmp_path, "qwen3", rope_scaling=scaling)
    loaded = load_model(str(path), "float32")
    rope = loaded.config.rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", scaling["factor"], 6)
    if "mscale" in scaling:  # 0.1 * mscale * ln(s) + 1 over the same with mscale_all_dim
        assert rope.attention_factor == pytest.approx((0.07 * np.log(8) + 1) / (0.1 * np.log(8) + 1))
    else:
        assert rope.attention_factor == pytest.approx(0.1 * np.log(4) + 1)
    got = PagedForward(loaded.config, loaded.params, backend="cpu").run(TOKENS, [9, 2, 30, 17], [6, 6, 1, 1, 1, 1])
    np.testing.assert_allclose(got, hf_logits(path, TOKENS), atol=2e-5, rtol=0)
