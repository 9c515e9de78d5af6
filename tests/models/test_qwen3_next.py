"""Qwen3-Next and Qwen3.5 (dense, MoE) with every layer full attention: float32 logits equal transformers' (gated
attention, (1 + weight) norms, partial rotary, MoE with a shared expert, a dense layer among the MoE ones), the
multimodal checkpoint's text decoder, the engine's greedy tokens, and the refusal of configs with gated DeltaNet
(linear-attention) layers, whose recurrent-state cache the engine does not have yet."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from jaxserve.config.model_config import ModelConfig
from jaxserve.config.qwen3_next_config import QWEN3_NEXT_FAMILIES as FAMILIES
from jaxserve.distributed.sharding import check_tensor_parallel
from jaxserve.testing.hf_reference import hf_greedy, hf_logits
from jaxserve.testing.tiny_models import FAMILY_TOKENS, save_tiny_model, tiny_qwen3_next_config
from jaxserve.weights import load_model
from tests.forward import PagedForward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {family: save_tiny_model(tmp_path_factory.mktemp(family), tiny_qwen3_next_config(family), seed=3)
            for family in FAMILIES}


def saved_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_configs_read_gate_norms_rotary_and_mlps(tiny):
    nxt, dense, moe = (ModelConfig.from_hf(saved_config(tiny[family])) for family in FAMILIES)
    for cfg in (nxt, dense, moe):
        assert cfg.attn_output_gate and cfg.qk_norm and (cfg.head_dim, cfg.rotary_dim) == (16, 8)
    assert nxt.sparse_layers == (True, False, True) and not nxt.norm_topk_prob
    assert nxt.shared_expert_intermediate_size == 40 and nxt.unrolled_layers
    assert dense.num_experts is None
    assert moe.sparse_layers == (True,) * 3 and moe.norm_topk_prob and not moe.unrolled_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_over_chunks_and_decode_steps(tiny, family):
    loaded = load_model(str(tiny[family]), "float32")
    expected = hf_logits(tiny[family], FAMILY_TOKENS)
    got = PagedForward(loaded.config, loaded.params, backend="reference", scan_layers=False).run(
        FAMILY_TOKENS, [3, 0, 5, 1], [7, 6, 1, 1, 1])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


def test_the_multimodal_checkpoints_text_decoder_equals_transformers(tmp_path):
    """A `Qwen3_5MoeForConditionalGeneration` saved by transformers (a one-block vision tower): the text config under
    `text_config`, the text weights under `model.language_model.`, the vision weights not read. Its logits of a
    text-only prompt (mRoPE with three equal rows of positions) are the plain partial rotary's."""
    import torch
    import transformers

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    config = transformers.Qwen3_5MoeConfig(text_config=tiny_qwen3_next_config("qwen3_5_moe_text").to_dict(),
                                           vision_config=vision)
    path = save_tiny_model(tmp_path, config, seed=3, model_class=transformers.Qwen3_5MoeForConditionalGeneration)
    assert any(name.startswith("model.visual.") for name in load_file(path / "model.safetensors"))
    loaded = load_model(str(path), "float32")
    assert (loaded.config.architecture, loaded.config.family) == ("Qwen3_5MoeForConditionalGeneration",
                                                                  "qwen3_5_moe_text")
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([FAMILY_TOKENS])).logits[0].numpy()
    got = PagedForward(loaded.config, loaded.params, backend="reference").run(FAMILY_TOKENS, [3, 0, 5, 1], [9, 7])
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


def test_engine_greedy_tokens_equal_transformers(tiny, tmp_path):
    """Qwen3-Next (MoE layers around a dense one) through `LLM.generate` on the cpu backend, prompts over blocks."""
    path = tiny["qwen3_next"]
    buckets = tmp_path / "buckets.toml"
    buckets.write_text("block_size = 8\n[decode]\nbatch_sizes = [2]\n[prefill]\nbatch_sizes = [1]\nlengths = [16]\n"
                       "[mixed]\nbatch_sizes = [2]\ntoken_counts = [16]\n[context]\nlengths = [64]\n")
    llm = LLM(str(path), dtype="float32", buckets=str(buckets), max_model_len=64, attention_backend="cpu")
    prompts, max_tokens = [list(range(5, 25)), [7, 8, 9]], 6
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, max_tokens) for p in prompts]


def test_configs_with_linear_attention_layers_are_refused_with_the_reason(tiny):
    hf = saved_config(tiny["qwen3_next"])
    hf.pop("layer_types")
    hf["num_hidden_layers"] = 8  # transformers' default: every fourth layer full attention
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf(hf)
    assert str(refused.value) == (
        "qwen3_next: 6 of 8 layers are gated DeltaNet linear attention (layers [0, 1, 2, 4, 5, 6]); their "
        "per-sequence recurrent-state cache is not implemented yet, so only configs whose every layer is "
        "full_attention are served")
    hybrid = {**saved_config(tiny["qwen3_5_text"]), "layer_types": ["linear_attention", "full_attention"] * 2,
              "num_hidden_layers": 4}
    with pytest.raises(ValueError, match=r"^qwen3_5_text: 2 of 4 layers are gated DeltaNet linear attention"):
        ModelConfig.from_hf(hybrid)
    with pytest.raises(ValueError, match=r"attention_bias=true \(biased q/k/v/o projections\) is not supported"):
        ModelConfig.from_hf({**saved_config(tiny["qwen3_5_moe_text"]), "attention_bias": True})
    # tensor parallelism splits the experts whole (tests/distributed/check_tensor_parallel.py serves it at tp 2)
    with pytest.raises(ValueError, match=r"num_experts \(5\) is not divisible by tensor_parallel_size \(2\)"):
        check_tensor_parallel(ModelConfig.from_hf(saved_config(tiny["qwen3_next"])), 2)
