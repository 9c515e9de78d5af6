"""Tiny GGUF files written from tiny Hugging Face directories the way llama.cpp's converter writes them, for the
GGUF loader's tests (its tensor names, its stacked experts, its fused Phi-3 tensors, DeepSeek's latent attention
as `deepseek2` in either of its kv_b layouts, and its metadata keys) and the GPU check scripts, and the block types
a tiny model's layers are stored in for the quantized-GGUF checks. gguf, safetensors and transformers' tokenizers
only: the package's own dependencies."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

from jaxserve.testing.tiny_models import VOCAB, byte_level_tokenizer

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    # Phi-3's fused projections keep their fusion: q | k | v rows, gate | up rows
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    # mixture of experts: the router, and Qwen2-MoE's shared expert and its gate
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    # DeepSeek (deepseek2): low-rank queries, the latent's projections, the router's correction bias (renamed
    # e_score_correction.bias first, as llama.cpp does), the shared experts
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "mlp.gate.e_score_correction": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# one expert's tensor: (layer, expert, projection); llama.cpp stacks a layer's experts into one [E, ...] tensor
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
# config.json model_type -> llama.cpp's architecture name (Mixtral is a Llama with experts there)
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
                 "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                 "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}  # Kimi K2 is a deepseek_v3
# how llama.cpp stores DeepSeek's kv_b_proj: "split" (since its weight-absorbed attention, April 2025) as attn_k_b
# (each head's key rows transposed) and attn_v_b, with the *_mla head sizes; "fused" (older files) as attn_kv_b
KV_B_LAYOUTS = ("split", "fused")

_Q = gguf.GGMLQuantizationType
# the kept types gguf's own quantizer writes (it has none for the K-quants), per layer tensor: a tiny model's layers
# stored in five of them (make_tiny_gguf's ``tensor_types``)
QUANTIZED_LAYER_TYPES = {"attn_q": _Q.Q8_0, "attn_k": _Q.Q4_0, "attn_v": _Q.Q4_1, "attn_output": _Q.Q5_0,
                         "ffn_gate": _Q.Q5_1, "ffn_up": _Q.Q4_0, "ffn_down": _Q.Q8_0}


def make_tiny_gguf(path: Path, hf_dir: Path, tensor_types: dict | None = None, kv_b_layout: str = "split") -> Path:
    """Writes a tiny HF directory (from `make_tiny_model`) as a float32 GGUF file the way llama.cpp's converter
    does (Llama and Mixtral: q/k rows permuted for its rotary layout; Gemma: norm weights stored as 1 + weight;
    experts stacked per layer; Phi-3: LongRoPE factors as tensors; DeepSeek: rows as in the checkpoint, kv_b_proj
    in ``kv_b_layout``, one of `KV_B_LAYOUTS`), with a byte-level BPE tokenizer (one merge).
    ``tensor_types``: a layer tensor's llama.cpp name ("attn_q", "ffn_down", ...) -> the `gguf.GGMLQuantizationType`
    its weight is stored in, quantized with gguf's own quantizer (F16 stored as float16)."""
    from safetensors.numpy import load_file

    if kv_b_layout not in KV_B_LAYOUTS:
        raise ValueError(f"unknown kv_b_layout {kv_b_layout!r}; one of {', '.join(KV_B_LAYOUTS)}")
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHITECTURES[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, arch, kv_b_layout)
    tensors = load_file(hf_dir / "model.safetensors")
    converted = _converted_tensors(tensors, cfg, arch, kv_b_layout)
    for gguf_name, tensor in [*converted, *_rope_factor_tensors(cfg)]:
        _add_tensor(writer, gguf_name, np.ascontiguousarray(tensor, dtype=np.float32), tensor_types or {})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer, gguf_name: str, tensor: np.ndarray, tensor_types: dict) -> None:
    parts = gguf_name.split(".")
    kind = tensor_types.get(parts[2]) if len(parts) == 4 and parts[3] == "weight" else None
    if kind is None:
        writer.add_tensor(gguf_name, tensor)
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(gguf_name, tensor.astype(np.float16))
    else:
        writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)


def _converted_tensors(tensors: dict[str, np.ndarray], cfg: dict, arch: str, kv_b_layout: str):
    gemma = arch.startswith("gemma")
    layer_names = GEMMA_LAYER_NAMES if gemma else LAYER_NAMES
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        if match := EXPERT_TENSOR.fullmatch(name):
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), EXPERT_STACKS[proj]), {})[int(expert)] = tensor
            continue
        if name.endswith("kv_b_proj.weight") and kv_b_layout == "split":
            yield from _split_kv_b(tensor, cfg, name.split(".")[2])
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name in GLOBAL_NAMES:
            gguf_name = GLOBAL_NAMES[name]
        else:
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:  # llama.cpp: reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2)
            n = heads[proj]
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        if gemma and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            tensor = tensor.reshape(-1)  # [1, hidden] stored as [hidden]
        yield gguf_name, tensor
    for (layer, stack), by_expert in sorted(experts.items()):
        yield f"blk.{layer}.{stack}.weight", np.stack([by_expert[e] for e in sorted(by_expert)])


def _split_kv_b(kv_b: np.ndarray, cfg: dict, layer: str):
    """llama.cpp's split of DeepSeek's kv_b_proj ([heads * (nope + v), rank]) for its weight-absorbed attention:
    attn_k_b, each head's key rows transposed ([heads, rank, nope]), and attn_v_b ([heads, v, rank])."""
    nope, rank = cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
    per_head = kv_b.reshape(cfg["num_attention_heads"], nope + cfg["v_head_dim"], rank)
    yield f"blk.{layer}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1)
    yield f"blk.{layer}.attn_v_b.weight", per_head[:, nope:]


def _rope_factor_tensors(cfg: dict):
    """Phi-3's LongRoPE factors: llama.cpp stores them as two global tensors; Llama 3's llama3 scaling as one
    factor per frequency (`rope_freqs`), computed as its converter does."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "llama3":
        return [("rope_freqs.weight", _llama3_rope_freqs(cfg, rope))]
    if kind != "longrope":
        return []
    return [("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)),
            ("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))]


def _llama3_rope_freqs(cfg: dict, rope: dict) -> np.ndarray:
    import math

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _write_metadata(writer, cfg: dict, arch: str, kv_b_layout: str) -> None:
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    # llama.cpp's absorbed latent attention has one kv head
    writer.add_head_count_kv(1 if arch == "deepseek2" and kv_b_layout == "split" else cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    rope = cfg.get("rope_parameters") or {}
    if arch not in ("llama", "phi3", "deepseek2"):
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "yarn":  # llama.cpp's YaRN keys
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                writer.add_float32(f"{arch}.rope.scaling.yarn_{key}", rope[key])
    if arch == "phi3":
        _write_phi3_metadata(writer, cfg)
    if arch == "deepseek2":
        _write_deepseek2_metadata(writer, cfg, kv_b_layout)
    elif "num_experts" in cfg or "num_local_experts" in cfg:
        _write_expert_metadata(writer, cfg, arch)
    _write_tokenizer(writer, cfg["vocab_size"])
    if cfg.get("pad_token_id") is not None:
        writer.add_pad_token_id(cfg["pad_token_id"])


def _write_phi3_metadata(writer, cfg: dict) -> None:
    """As llama.cpp's Phi-3 converter: the rotary dimension, the window (0: none, Phi-4), LongRoPE's pretraining
    length and attention factor."""
    import math

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    original = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        attn_factor = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
        writer.add_rope_scaling_attn_factors(attn_factor)


def _write_deepseek2_metadata(writer, cfg: dict, kv_b_layout: str) -> None:
    """As llama.cpp's DeepseekV2Model: the ranks, the head sizes (``kv_b_layout`` "split": key and value lengths
    those of its absorbed form's one kv head, the per-head ones as *_mla; "fused": the per-head ones), the rotary
    dimension, the routing, and YaRN's mscale_all_dim as 0.1 * it (llama.cpp takes mscale to be mscale_all_dim)."""
    rank, rope_dim, v_head_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qk_head_dim = cfg["qk_nope_head_dim"] + rope_dim
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    if kv_b_layout == "split":
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(qk_head_dim)
        writer.add_value_length_mla(v_head_dim)
    else:
        writer.add_key_length(qk_head_dim)
        writer.add_value_length(v_head_dim)
    writer.add_rope_dimension_count(rope_dim)
    _write_deepseek2_routing(writer, cfg)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("mscale_all_dim") is not None:
        if rope.get("mscale") not in (None, rope["mscale_all_dim"]):
            raise ValueError("llama.cpp's deepseek2 files carry mscale_all_dim only (mscale taken to be equal); "
                             f"this config's mscale {rope['mscale']} != mscale_all_dim {rope['mscale_all_dim']}")
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _write_deepseek2_routing(writer, cfg: dict) -> None:
    """The experts and their routing. transformers' configs drop the hub checkpoints' `scoring_func` (V3 and Kimi
    K2: sigmoid; V2: softmax), which llama.cpp writes as expert_gating_func: it is taken from the model type."""
    scoring = cfg.get("scoring_func") or ("sigmoid" if cfg["model_type"] == "deepseek_v3" else "softmax")
    writer.add_expert_count(cfg["n_routed_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    if cfg.get("n_group") is not None:
        writer.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        writer.add_expert_group_used_count(cfg["topk_group"])
    gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    writer.add_expert_gating_func(gating[scoring])
    if cfg.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)


def _write_expert_metadata(writer, cfg: dict, arch: str) -> None:
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _write_tokenizer(writer, vocab_size: int) -> None:
    tokens = [f"<unused{i}>" for i in range(vocab_size)]
    for token, index in byte_level_tokenizer().get_vocab().items():
        tokens[index] = token
    tokens[VOCAB - 1] = "he"
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])  # 3: control, 1: normal
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
