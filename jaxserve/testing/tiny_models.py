"""Tiny random Hugging Face models of each supported family, saved as model directories (safetensors, config.json
and a byte-level tokenizer) for the tests and the GPU check scripts; the families' tiny configs and a prompt that
crosses their windows. transformers and torch (the `test` extra) are imported when called."""

from __future__ import annotations

from pathlib import Path

VOCAB = 320  # 3 special tokens + 256 byte tokens + unused ids


def tiny_hf_config(family: str, **overrides):
    import transformers

    if family in LEARNED_POSITION_CONFIGS:
        config = LEARNED_POSITION_CONFIGS[family](**overrides)
        config._attn_implementation = "eager"
        return config
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "gemma4": transformers.Gemma4TextConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
    }
    config = classes[family](**{**common, **FAMILY_DEFAULTS.get(family, {}), **overrides})
    config._attn_implementation = "eager"
    return config


# What a tiny config of a family sets beyond the common fields: its own token ids, a head_dim that is not
# hidden / heads, short sliding windows (so the test prompts cross them), small expert MLPs.
FAMILY_DEFAULTS = {
    "qwen3": dict(head_dim=24),
    "phi3": dict(pad_token_id=0, eos_token_id=2, partial_rotary_factor=0.5),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma3": dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=5, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # every Gemma 4 feature: full layers of another head_dim and kv heads whose V is K, the last three layers
    # reading earlier layers' caches (with twice as wide MLPs), per-layer inputs, experts beside the MLP
    "gemma4": dict(head_dim=24, global_head_dim=48, num_global_key_value_heads=1, attention_k_eq_v=True,
                   num_hidden_layers=7, sliding_window=5, num_kv_shared_layers=3, use_double_wide_mlp=True,
                   layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3
                   + ["full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 10000.0}},
                   hidden_size_per_layer_input=12, vocab_size_per_layer_input=VOCAB, enable_moe_block=True,
                   num_experts=5, top_k_experts=2, moe_intermediate_size=40, final_logit_softcapping=30.0,
                   tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # latent attention (rank 20, rotary 8, nope 12, values 16: all different), low-rank queries, YaRN with
    # mscale != mscale_all_dim, group-limited sigmoid routing with a correction bias, a shared expert, one dense layer
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
                        qk_rope_head_dim=8, v_head_dim=16,
                        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
                        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True,
                        moe_intermediate_size=32, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 0.8}),
    # DeepSeek-V2-Lite's shape: one q_proj, softmax routing (greedy), two shared experts, no renormalisation
    "deepseek_v2": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=12,
                        qk_rope_head_dim=8, v_head_dim=16,
                        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=6, num_experts_per_tok=2,
                        topk_method="greedy", n_group=None, topk_group=None, n_shared_experts=2,
                        routed_scaling_factor=1.0, moe_intermediate_size=32, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 0.707, "mscale_all_dim": 0.707}),
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96),
    # a SwiGLU limit of 1 so that the tiny weights' gates and ups reach the clamps
    "gpt_oss": dict(head_dim=24, intermediate_size=48, num_local_experts=5, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 128,
                                     "rope_theta": 150000.0}),
}


# A tiny Llama the attention kernels take (head_dim 64 = hidden 256 / 4 heads, GQA 2:1): make_tiny_model(..., **TINY_64)
TINY_64 = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


# The families beyond Llama as tiny configs (family, overrides), and a prompt three times their windows: their
# parity tests (tests/models/test_families.py) and scripts/check_family_bf16.py run these
FAMILY_TOKENS = [1, 17, 200, 3, 99, 45, 45, 8, 120, 250, 11, 64, 7, 31, 5, 260]  # 16 tokens; windows are 5 or 6

TINY_FAMILIES = {
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "phi3-partial-rotary": ("phi3", {}),
    "phi3-sliding-window": ("phi3", {"partial_rotary_factor": 1.0, "sliding_window": 6, "num_key_value_heads": 1}),
    "gemma2-softcaps": ("gemma2", {}),
    "gemma3-local-rope": ("gemma3", {}),
    "gemma3-mha-tied": ("gemma3", {"num_key_value_heads": 4, "tie_word_embeddings": True, "layer_types": None,
                                   "num_hidden_layers": 7}),
    "mixtral": ("mixtral", {"sliding_window": 6}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False, "num_experts": 5, "num_experts_per_tok": 2}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {}),
    # dense and MoE layers mixed: layers 0 and 2 dense by mlp_only_layers; every other layer by decoder_sparse_step
    "qwen3-moe-mlp-only-layers": ("qwen3_moe", {"num_hidden_layers": 4, "mlp_only_layers": [0, 2]}),
    "qwen2-moe-sparse-step": ("qwen2_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2}),
    "gpt-oss": ("gpt_oss", {}),
    "gemma4": ("gemma4", {}),
    "deepseek-v3": ("deepseek_v3", {}),
    "deepseek-v2-lite": ("deepseek_v2", {}),
    # Kimi K2's shape (a DeepSeek-V3 architecture): one group of experts, YaRN with beta_fast = beta_slow and
    # mscale = mscale_all_dim, another rope base, qk_nope_head_dim above v_head_dim
    "kimi-k2": ("deepseek_v3", {"n_group": 1, "topk_group": 1, "n_routed_experts": 7, "num_experts_per_tok": 2,
                                "routed_scaling_factor": 2.8, "qk_nope_head_dim": 16, "v_head_dim": 8,
                                "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                    "original_max_position_embeddings": 32, "beta_fast": 1,
                                                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # V2's group-limited greedy routing (groups by their best expert) and every layer MoE (scanned)
    "deepseek-v2-group-limited": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3,
                                                  "topk_group": 2, "first_k_dense_replace": 0}),
    # Gemma 4 without PLE, experts or KV sharing (the 31B's shape): V its own projection, one kind of kv heads
    "gemma4-dense": ("gemma4", {"hidden_size_per_layer_input": 0, "enable_moe_block": False,
                                "num_kv_shared_layers": 0, "attention_k_eq_v": False, "num_hidden_layers": 3,
                                "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q/k/v and o_proj biases (Qwen2 has no o bias)
}


def longrope_overrides(num_factors: int, original_max_position_embeddings: int) -> dict:
    """A Phi-3 config's LongRoPE fields (Phi-4-mini's layout): short and long factors per rotary frequency, far
    enough apart that the two give visibly different logits."""
    return dict(
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(num_factors)],
                      "long_factor": [2.0 + 3.0 * i for i in range(num_factors)]},
        original_max_position_embeddings=original_max_position_embeddings,
    )


def _tiny_opt_config(**overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return transformers.OPTConfig(**{**common, **overrides})


def _tiny_gpt2_config(**overrides):
    import transformers

    common = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2Config(**{**common, **overrides})


LEARNED_POSITION_CONFIGS = {"opt": _tiny_opt_config, "gpt2": _tiny_gpt2_config}


# Qwen3-Next and Qwen3.5 with every layer full attention (the engine refuses their linear-attention layers for now):
# held-out odd shapes (hidden 48, 4 query and 2 kv heads of 16, rotary over half of each head), experts with a shared
# expert, Qwen3-Next's layer 1 dense (mlp_only_layers) and its routing weights not renormalised
_QWEN3_NEXT_COMMON = dict(
    vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["full_attention"] * 3, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
_QWEN3_NEXT_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40)


def tiny_qwen3_next_config(family: str, **overrides):
    """A tiny transformers config of `family` (of `qwen3_next_config.QWEN3_NEXT_FAMILIES`), for `save_tiny_model`."""
    import transformers

    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{**_QWEN3_NEXT_COMMON, **_QWEN3_NEXT_MOE, "intermediate_size": 80,
                                                 "mlp_only_layers": [1], "norm_topk_prob": False, **overrides})
    elif family == "qwen3_5_text":
        config = transformers.Qwen3_5TextConfig(**{**_QWEN3_NEXT_COMMON, "intermediate_size": 80, **overrides})
    else:
        config = transformers.Qwen3_5MoeTextConfig(**{**_QWEN3_NEXT_COMMON, **_QWEN3_NEXT_MOE, **overrides})
    config._attn_implementation = "eager"
    return config


def make_tiny_model(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a seeded random model (safetensors + config.json) and a byte-level tokenizer into `path`."""
    return save_tiny_model(path, tiny_hf_config(family, **overrides), seed)


def save_tiny_model(path: Path, config, seed: int = 0, model_class=None) -> Path:
    """Saves a seeded random model of a transformers `config` (its weights scaled up as `make_tiny_model` says) and
    a byte-level tokenizer into `path`; `model_class`: the transformers class to save (default: the causal LM that
    `AutoModelForCausalLM` picks for the config)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config) if model_class is None else model_class(config)
    model.eval()
    hidden_size = config.get_text_config().hidden_size  # a multimodal config's text decoder's
    with torch.no_grad():  # larger weights than the default init, so logits differ visibly
        for param in model.parameters():
            param.normal_(0.0, 0.15 if param.dim() > 1 else 0.5)
            if param.dim() == 1 and param.shape[0] == hidden_size:
                param.add_(1.0)
        for name, buffer in model.named_buffers():  # Gemma 4's per-layer scale of the residual stream
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: large enough to matter
                buffer.normal_(0.0, 0.5)
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def byte_level_tokenizer():
    """A byte-level BPE tokenizer without merges: ids 0-2 are <unk>, <s>, </s>, then one id per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(alphabet))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
    )
