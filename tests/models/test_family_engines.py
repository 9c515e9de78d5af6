"""The engine serves every family: greedy tokens equal transformers' `generate` on tiny random models, with
prompts longer than the sliding windows, mixed steps and prefix caching on (the second round of prompts
shares the first's prefixes and must hit the cache), on the cpu backend (the CPU default), and gpt-oss's per-layer
windows and sinks on the Pallas kernels (interpreted; head_dim 64, a layout the TPU kernels take; their soft-cap
is in tests/kernels; a MoE block is the same on every attention backend)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.testing.hf_reference import hf_greedy
from jaxserve.testing.tiny_models import longrope_overrides, make_tiny_model

BUCKETS = """block_size = {block_size}
[decode]
batch_sizes = [4]
[prefill]
batch_sizes = [1]
lengths = [16]
[mixed]
batch_sizes = [4]
token_counts = [16]
[context]
lengths = [64]
"""
MAX_TOKENS = 8
PROMPTS = [list(range(5, 25)), [7, 8, 9], list(range(100, 130))]  # 20, 3 and 30 tokens; windows are 5 or 6
SHARED = [p + [3, 4] for p in PROMPTS]  # the same prefixes: whole cached blocks are reused

# (family, overrides, attention backend); head_dim 64 (hidden 128 / 2 heads) for the Pallas kernels
CASES = {
    "qwen3": ("qwen3", {}, "cpu"),
    # LongRoPE pretrained on 2 positions: transformers takes the long factors for every prompt, as the engine
    # does for its max_model_len of 64 (partial rotary: 4 frequencies)
    "phi3-longrope": ("phi3", {"sliding_window": 6, **longrope_overrides(4, 2)}, "cpu"),
    "gemma2": ("gemma2", {}, "cpu"),
    "gemma3": ("gemma3", {}, "cpu"),
    "qwen3-moe-dense-first-layer": ("qwen3_moe", {"mlp_only_layers": [0]}, "cpu"),  # layers mixing MLP kinds
    "mixtral": ("mixtral", {"sliding_window": 6}, "cpu"),
    # (Gemma 4: tests/engine/test_gemma4_engine.py, whose engine takes these buckets, mixed steps and prefix caching)
    # latent attention over a pool of latents, group-limited sigmoid routing
    "deepseek-v3": ("deepseek_v3", {}, "cpu"),
    # attention sinks and per-layer windows (Gemma 3's too: the same traced window) through the Pallas kernels,
    # biased experts with clamped SwiGLU
    "gpt-oss-pallas": ("gpt_oss", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                                   "head_dim": 64}, "pallas"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_tokens_equal_transformers_with_mixed_steps_and_prefix_caching(tmp_path, case):
    family, overrides, backend = CASES[case]
    path = make_tiny_model(tmp_path / "m", family, seed=4, **overrides)
    buckets = tmp_path / "buckets.toml"
    block_size = 16 if backend == "pallas" else 8  # the Pallas kernels take pages of 16 tokens or more
    buckets.write_text(BUCKETS.format(block_size=block_size))
    llm = LLM(str(path), dtype="float32", buckets=str(buckets), max_model_len=64, attention_backend=backend,
              enable_prefix_caching=True)
    # `hf_greedy` generates with min_new_tokens: EOS is suppressed until the last token, so here too (min_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    prompts = PROMPTS + SHARED
    outputs = []
    for batch in (PROMPTS, SHARED):  # the second batch after the first finished: its prefixes are cached
        outputs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]
    stats = llm.llm_engine.stats
    assert stats.num_mixed_steps > 0  # decode rows rode along with prefill chunks
    # every whole block of the shared prefix is reused, and nothing else
    expected_cached = [len(p) // block_size * block_size for p in PROMPTS]
    assert [o.num_cached_tokens for o in outputs[len(PROMPTS):]] == expected_cached
