"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, V2-Lite, V3, Kimi K2): transformers reads none, so a file written
from a tiny Hugging Face directory as llama.cpp's converter writes it (`make_tiny_gguf`) must load to the directory's
own params and config, and to transformers' logits on the directory."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_gguf import make_tiny_gguf
from jaxserve.testing.tiny_models import TINY_FAMILIES, make_tiny_model
from jaxserve.weights import load_model
from jaxserve.weights.gguf_file import hf_name
from tests.forward import PagedForward
from tests.weights.test_weights import assert_same_tree

TOKENS = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64]
# the V3 tiny's YaRN with mscale = mscale_all_dim (both 0.8, not 1): llama.cpp's files keep mscale_all_dim only and
# take mscale to equal it, as every DeepSeek and Kimi checkpoint has it
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8}

# case: (tiny family, overrides, kv_b layout, what its config must read back: architecture, routing, q_lora_rank,
# groups, correction bias)
CASES = {
    # low-rank queries, sigmoid routing within 2 of 4 groups with the correction bias (exp_probs_b), a shared
    # expert, renormalised and scaled weights, one dense first layer; current llama.cpp's attn_k_b / attn_v_b
    "deepseek-v3-split": ("deepseek-v3", {"rope_parameters": V3_YARN}, "split",
                          ("DeepseekV3ForCausalLM", "noaux_tc", 24, 4, True)),
    # one q_proj (attn_q), softmax greedy routing, two shared experts
    "deepseek-v2-lite-split": ("deepseek-v2-lite", {}, "split", ("DeepseekV2ForCausalLM", "greedy", None, 1, False)),
    # older files: one attn_kv_b and the per-head key_length / value_length
    "deepseek-v2-lite-fused": ("deepseek-v2-lite", {}, "fused", ("DeepseekV2ForCausalLM", "greedy", None, 1, False)),
    # V2's group-limited routing (3 groups, the best 2 by their best expert) from the expert group counts
    "deepseek-v2-group-limited-split": ("deepseek-v2-group-limited", {}, "split",
                                        ("DeepseekV2ForCausalLM", "group_limited_greedy", None, 3, False)),
    # Kimi K2's shape (one group, beta_fast = beta_slow = 1, mscale_all_dim 1) in the older layout
    "kimi-k2-fused": ("kimi-k2", {}, "fused", ("DeepseekV3ForCausalLM", "noaux_tc", 24, 1, True)),
}


def load_both(tmp_path, case: str):
    """(the GGUF written from the case's tiny HF dir, loaded; the HF dir, loaded; the HF dir)."""
    name, overrides, layout, _ = CASES[case]
    family, defaults = TINY_FAMILIES[name]
    hf_dir = make_tiny_model(tmp_path / "hf", family, **{**defaults, **overrides})
    from_gguf = load_model(str(make_tiny_gguf(tmp_path / f"{case}.gguf", hf_dir, kv_b_layout=layout)), "float32")
    return from_gguf, load_model(str(hf_dir), "float32"), hf_dir


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek2_gguf_loads_as_the_hugging_face_model(tmp_path, case):
    """The file's config and params are the HF dir's (whose own loader equals transformers: the families' tests)."""
    expected = CASES[case][3]
    from_gguf, from_hf, _ = load_both(tmp_path, case)
    cfg, mla, hf_mla = from_gguf.config, from_gguf.config.mla, from_hf.config.mla
    assert (cfg.architecture, mla.routing, mla.q_lora_rank, mla.n_group, mla.correction_bias) == expected
    # GGUF keeps the epsilon, the routed scaling factor and 0.1 * mscale_all_dim in float32
    float32_fields = ("softmax_mscale", "routed_scaling_factor")
    assert [getattr(mla, f) for f in float32_fields] == pytest.approx([getattr(hf_mla, f) for f in float32_fields],
                                                                      rel=1e-7)
    stored = dataclasses.replace(from_hf.config, rms_norm_eps=float(np.float32(from_hf.config.rms_norm_eps)),
                                 mla=dataclasses.replace(hf_mla, **{f: getattr(mla, f) for f in float32_fields}))
    assert cfg == stored
    assert_same_tree(from_gguf.params, from_hf.params)


def test_a_deepseek2_gguf_gives_transformers_logits(tmp_path):
    from_gguf, _, hf_dir = load_both(tmp_path, "deepseek-v3-split")
    got = PagedForward(from_gguf.config, from_gguf.params).run(TOKENS, [0, 1, 2], [len(TOKENS)])
    np.testing.assert_allclose(got, hf_logits(hf_dir, TOKENS), atol=2e-5, rtol=0)


def test_deepseek2_tensor_names_map_to_the_checkpoint():
    assert hf_name("blk.1.attn_q_a.weight", "deepseek2") == "model.layers.1.self_attn.q_a_proj.weight"
    assert hf_name("blk.1.attn_kv_a_mqa.weight", "deepseek2") == "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert hf_name("blk.1.attn_kv_b.weight", "deepseek2") == "model.layers.1.self_attn.kv_b_proj.weight"
    assert hf_name("blk.2.exp_probs_b.bias", "deepseek2") == "model.layers.2.mlp.gate.e_score_correction_bias"
    assert hf_name("blk.2.ffn_up_shexp.weight", "deepseek2") == "model.layers.2.mlp.shared_experts.up_proj.weight"
    assert hf_name("blk.2.attn_k_b.weight", "deepseek2") is None  # with attn_v_b: kv_b_proj put back together


def test_deepseek2_gguf_without_a_required_key_or_tensor_names_it(tmp_path, monkeypatch):
    hf_dir = make_tiny_model(tmp_path / "hf", "deepseek_v2", num_hidden_layers=2)

    def written_with(name: str, method: str, replacement):
        with monkeypatch.context() as patch:
            patch.setattr(gguf.GGUFWriter, method, replacement)
            return str(make_tiny_gguf(tmp_path / name, hf_dir))

    no_rank = written_with("no-rank.gguf", "add_kv_lora_rank", lambda writer, rank: None)
    with pytest.raises(ValueError, match=r"no-rank.gguf lacks the metadata key 'deepseek2.attention.kv_lora_rank'"):
        load_model(no_rank, "float32")
    add_tensor = gguf.GGUFWriter.add_tensor
    no_v_b = written_with("no-v-b.gguf", "add_tensor", lambda writer, name, *args, **kwargs: None
                          if name == "blk.1.attn_v_b.weight" else add_tensor(writer, name, *args, **kwargs))
    with pytest.raises(ValueError, match=r"no-v-b.gguf lacks the tensors for model.layers.1.self_attn.kv_b_proj.weight"
                       r": blk.1.attn_kv_b.weight, or blk.1.attn_k_b.weight and blk.1.attn_v_b.weight"):
        load_model(no_v_b, "float32")
    add_uint32 = gguf.GGUFWriter.add_uint32
    unknown_gating = written_with("gating.gguf", "add_uint32", lambda writer, key, value: add_uint32(
        writer, key, 3 if key.endswith("expert_gating_func") else value))  # llama.cpp's sqrtsoftplus
    with pytest.raises(ValueError, match=r"unsupported deepseek2.expert_gating_func 3; supported: 1 \(softmax\)"):
        load_model(unknown_gating, "float32")
