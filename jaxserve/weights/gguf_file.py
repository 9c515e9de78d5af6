"""Loads a GGUF file (llama.cpp's format): config from its metadata, tensors dequantized with `gguf` (or, served
with quantization="gguf", the quantized layers' blocks kept as int8 codes: `gguf_blocks`).

The metadata becomes a Hugging Face config dict (`ModelConfig.from_hf` reads it as it reads config.json), and
tensors get their Hugging Face names, so both loaders share `convert.py`. llama.cpp stores `attn_q`/`attn_k`
rows of Llama models (Mixtral too) permuted for its rotary layout and Gemma's norm weights as 1 + weight; both
are undone here. It stacks a layer's experts into one tensor per projection (`ffn_gate_exps`: [E, I, H]),
which is dequantized once and served to `convert.py` expert by expert; Phi-3 keeps its fused `attn_qkv` and
`ffn_up` (gate | up) as the Hugging Face checkpoint has them, and its LongRoPE factors as two tensors.

DeepSeek-V2/V3 and Kimi K2 are llama.cpp's `deepseek2`: rows as in the checkpoint (its rotary pairs interleaved,
which `convert.py` permutes as for the checkpoint), the ranks and head sizes in `attention.*` keys, the routing in
`expert_*` keys (a sigmoid router, with its correction bias `exp_probs_b`, is V3's; a softmax one V2's). Files
written since llama.cpp's weight-absorbed attention (April 2025) split kv_b_proj into `attn_k_b` (each head's key
rows transposed) and `attn_v_b` and give the per-head sizes as `key_length_mla`/`value_length_mla` (their
`key_length`/`value_length` are the absorbed form's); older ones keep `attn_kv_b` and the per-head `key_length`.
Both load; kv_b_proj is put back together from the split (`SplitKvB`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.quantization_config import parse_quantization
from jaxserve.quantization.weights import QuantizedTensor, grouped_experts_refusal
from jaxserve.weights.convert import params_from_hf
from jaxserve.weights.gguf_blocks import grouped_codes

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM where it has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # DeepseekV3ForCausalLM where its router is sigmoid (V3, Kimi K2)
}
QWEN_MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")
EXPERT_GATING_SOFTMAX, EXPERT_GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values
# architectures whose config transformers' GGUF reader does not read: their tokenizer loads without it
TOKENIZER_ONLY_GGUF_ARCHITECTURES = ("deepseek2",)
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm before the MLP there
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_QWEN_MOE_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MIXTRAL_LAYER_TENSORS = {**_LAYER_TENSORS, "ffn_gate_inp": "block_sparse_moe.gate"}
_DEEPSEEK2_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older files; newer ones split it (`SplitKvB`)
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",  # .bias: the checkpoint's e_score_correction_bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# a layer's stacked experts -> the Hugging Face names of one expert's projection (Qwen-MoE, Mixtral)
_EXPERT_STACKS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                  "ffn_down_exps": ("down_proj", "w2")}
_EXPERT_STACK_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _layer_tensors(arch: str, moe: bool) -> dict[str, str]:
    if arch in GEMMA_ARCHITECTURES:
        return _GEMMA_LAYER_TENSORS
    if arch == "phi3":
        return _PHI3_LAYER_TENSORS
    if arch in QWEN_MOE_ARCHITECTURES:
        return _QWEN_MOE_LAYER_TENSORS
    if arch == "deepseek2":
        return _DEEPSEEK2_LAYER_TENSORS
    return _MIXTRAL_LAYER_TENSORS if moe else _LAYER_TENSORS


def hf_name(gguf_name: str, arch: str = "llama", moe: bool = False) -> str | None:
    """GGUF tensor name → Hugging Face name (None for tensors the model does not use, for stacked experts:
    `expert_names`, and for DeepSeek's split kv_b: `SplitKvB`). `moe`: a Llama-architecture file with experts
    (Mixtral)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _layer_tensors(arch, moe)
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_tensors:
        name = f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
        return name.replace("e_score_correction.bias", "e_score_correction_bias")
    return None


def expert_names(gguf_name: str, arch: str, num_experts: int) -> list[str]:
    """The Hugging Face names of the experts a stacked GGUF tensor holds, in order ([] for other tensors)."""
    match = _EXPERT_STACK_NAME.fullmatch(gguf_name)
    if match is None:
        return []
    layer, (qwen_proj, mixtral_proj) = match.group(1), _EXPERT_STACKS[match.group(2)]
    if arch == "llama":
        return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral_proj}.weight" for e in range(num_experts)]
    return [f"model.layers.{layer}.mlp.experts.{e}.{qwen_proj}.weight" for e in range(num_experts)]


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader, key: str):
    """The metadata value of ``key``; a clear error where the file lacks it."""
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF file {reader.data.filename} lacks the metadata key {key!r}")
    return value


def gguf_architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def read_gguf_architecture(path: Path) -> str | None:
    """The file's `general.architecture` (whatever it is; `gguf_architecture` checks it)."""
    import gguf

    return _field(gguf.GGUFReader(str(path)), "general.architecture")


def read_gguf_hf_config(path: Path) -> dict:
    """The Hugging Face config dict of the GGUF file ``path`` (`gguf_hf_config`)."""
    import gguf

    return gguf_hf_config(gguf.GGUFReader(str(path)))


def gguf_model_config(hf_config: dict, quantization: str | None = None) -> ModelConfig:
    """The ModelConfig a GGUF file serves as, from its metadata as a Hugging Face config dict (`gguf_hf_config`;
    the converted-weights cache keeps that dict): with quantization="gguf" it carries the scheme its blocks are
    kept in; the other schemes are applied after loading."""
    config = ModelConfig.from_hf(hf_config)
    if quantization == "gguf":
        return dataclasses.replace(config, quantization=parse_quantization("gguf"))
    return config


def gguf_hf_config(reader) -> dict:
    """The GGUF metadata as a Hugging Face config.json dict."""
    arch = gguf_architecture(reader)
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, tensors.get("rope_freqs.weight")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    if arch in GEMMA_ARCHITECTURES:
        hf.update(_gemma_metadata(reader, arch))
    if arch == "phi3":
        hf.update(_phi3_metadata(reader, hf, tensors))
    if arch == "deepseek2":
        hf.update(_deepseek2_metadata(reader, hf, tensors))
    elif _field(reader, f"{arch}.expert_count"):
        hf.update(_expert_metadata(reader, arch, tensors, hf["num_hidden_layers"]))
    return hf


def _deepseek2_metadata(reader, hf: dict, tensors: dict) -> dict:
    """llama.cpp's DeepSeek keys as the checkpoint's config.json ones: the latent attention's ranks and per-head
    sizes (`*_mla` in newer files, module docstring), the MoE (`_deepseek2_routing`), YaRN's mscale_all_dim."""
    key = "deepseek2.attention"
    if _field(reader, f"{key}.temperature_scale"):  # Mistral Large 3's llama.cpp files
        raise ValueError(f"unsupported GGUF key {key}.temperature_scale: attention temperature tuning")
    rope_dim = int(_required(reader, "deepseek2.rope.dimension_count"))
    mla = _field(reader, f"{key}.key_length_mla") is not None
    qk_head_dim = int(_required(reader, f"{key}.key_length_mla" if mla else f"{key}.key_length"))
    q_lora_rank = _field(reader, f"{key}.q_lora_rank")
    if q_lora_rank is None and "blk.0.attn_q_a.weight" in tensors:
        q_lora_rank = _required(reader, f"{key}.q_lora_rank")
    fields = {
        "kv_lora_rank": int(_required(reader, f"{key}.kv_lora_rank")),
        "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": int(_required(reader, f"{key}.value_length_mla" if mla else f"{key}.value_length")),
        "head_dim": rope_dim,  # as transformers' DeepSeek configs have it; the latent's sizes are the ones read
        "num_key_value_heads": hf["num_attention_heads"],  # the checkpoint's; llama.cpp's absorbed form has 1
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
        **_deepseek2_routing(reader),
    }
    log_mul = _field(reader, "deepseek2.rope.scaling.yarn_log_multiplier")
    if hf["rope_scaling"] and hf["rope_scaling"]["rope_type"] == "yarn" and log_mul:
        # llama.cpp stores 0.1 * mscale_all_dim and takes mscale (the cos/sin scale's numerator) to be equal to it
        mscale = float(log_mul) / 0.1
        fields["rope_scaling"] = {**hf["rope_scaling"], "mscale": mscale, "mscale_all_dim": mscale}
    return fields


def _deepseek2_routing(reader) -> dict:
    """A sigmoid router is V3's (noaux_tc with its correction bias; Kimi K2 too), a softmax one (llama.cpp's
    default) V2's, its experts chosen within the best groups where they are grouped (group_limited_greedy)."""

    def value(key: str, default=None):
        return _field(reader, f"deepseek2.{key}", default)

    gating = int(value("expert_gating_func", EXPERT_GATING_SOFTMAX))
    if gating not in (EXPERT_GATING_SOFTMAX, EXPERT_GATING_SIGMOID):
        raise ValueError(f"unsupported deepseek2.expert_gating_func {gating}; supported: "
                         f"{EXPERT_GATING_SOFTMAX} (softmax), {EXPERT_GATING_SIGMOID} (sigmoid)")
    sigmoid = gating == EXPERT_GATING_SIGMOID
    n_group, topk_group = value("expert_group_count"), value("expert_group_used_count")
    fields = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if (n_group or 1) > 1 else "greedy",
        "n_group": None if n_group is None else int(n_group),
        "topk_group": None if topk_group is None else int(topk_group),
        "first_k_dense_replace": int(value("leading_dense_block_count", 0)),
        "n_shared_experts": int(value("expert_shared_count", 0)),
        "routed_scaling_factor": float(value("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(value("expert_weights_norm", False)),
        "n_routed_experts": None,
    }
    if value("expert_count"):
        fields["n_routed_experts"] = int(value("expert_count"))
        fields["num_experts_per_tok"] = int(_required(reader, "deepseek2.expert_used_count"))
        fields["moe_intermediate_size"] = int(_required(reader, "deepseek2.expert_feed_forward_length"))
    return fields


def _gemma_metadata(reader, arch: str) -> dict:
    """llama.cpp keeps Gemma's window and soft-caps; the rest is fixed by the architecture (as in llama.cpp
    and transformers' GGUF reader): local rope base 10000 (Gemma 3), scores scaled by 1/sqrt(head_dim)."""
    hf = {
        "sliding_window": _field(reader, f"{arch}.attention.sliding_window"),
        "query_pre_attn_scalar": int(_field(reader, f"{arch}.attention.key_length")),
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma3":
        hf["rope_local_base_freq"] = 10000.0
    return hf


def _rope_scaling(reader, arch: str, rope_freqs) -> dict | None:
    """llama.cpp's linear and YaRN scaling keys as transformers' `rope_scaling` (Phi-3's LongRoPE: below), and
    its per-frequency factors (`rope_freqs`: the llama3 scaling of Llama 3.1 and later, precomputed)."""
    if rope_freqs is not None:
        return {"rope_type": "default", "frequency_factors": dequantize_tensor(rope_freqs).tolist()}
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        return None
    scaling = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(_field(reader, f"{arch}.rope.scaling.original_context_length"))}
    for key in ("beta_fast", "beta_slow"):
        if _field(reader, f"{arch}.rope.scaling.yarn_{key}") is not None:
            scaling[key] = float(_field(reader, f"{arch}.rope.scaling.yarn_{key}"))
    return scaling


def _phi3_metadata(reader, hf: dict, tensors: dict) -> dict:
    """llama.cpp's Phi-3 keys: the rotary dimension (partial rotary), the window (0: none, as Phi-4 has), and for
    LongRoPE the pretraining length, the attention factor and the two factor tensors."""
    rotary_dim = int(_field(reader, "phi3.rope.dimension_count", hf["head_dim"]))
    window = _field(reader, "phi3.attention.sliding_window", 0)
    fields = {"partial_rotary_factor": rotary_dim / hf["head_dim"], "sliding_window": int(window) or None}
    if "rope_factors_long.weight" in tensors:
        fields["original_max_position_embeddings"] = int(_field(reader, "phi3.rope.scaling.original_context_length"))
        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": dequantize_tensor(tensors["rope_factors_long.weight"]).tolist(),
            "short_factor": dequantize_tensor(tensors["rope_factors_short.weight"]).tolist(),
            "attention_factor": _field(reader, "phi3.rope.scaling.attn_factor"),
        }
    return fields


def _expert_metadata(reader, arch: str, tensors: dict, num_layers: int) -> dict:
    """Expert counts and sizes; a layer without a router is a dense one (Qwen-MoE's mlp_only_layers). Top-k
    weights are renormalised as llama.cpp does per architecture unless the file says otherwise."""
    fields = {
        "num_experts": int(_field(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", arch != "qwen2moe")),
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }
    if arch == "llama":
        fields["architectures"] = ["MixtralForCausalLM"]
    if _field(reader, f"{arch}.expert_feed_forward_length"):
        fields["moe_intermediate_size"] = int(_field(reader, f"{arch}.expert_feed_forward_length"))
    if _field(reader, f"{arch}.expert_shared_feed_forward_length"):
        fields["shared_expert_intermediate_size"] = int(_field(reader, f"{arch}.expert_shared_feed_forward_length"))
    return fields


def dequantize_tensor(tensor) -> np.ndarray:
    """float32 array in numpy (row-major, Hugging Face) shape; clear error for unsupported types."""
    from gguf.quants import dequantize

    type_name = tensor.tensor_type.name
    try:
        if type_name in _FLOAT_TYPES:
            array = np.asarray(tensor.data).astype(np.float32)
        elif type_name.startswith("I") and not type_name.startswith("IQ"):
            raise NotImplementedError
        else:
            array = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"unsupported GGUF tensor type {type_name} for tensor {tensor.name!r}"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return array.astype(np.float32).reshape(shape)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's rotary row permutation of q/k weights ([out, in]) or biases ([out])."""
    tail = weight.shape[1:]
    return weight.reshape(num_heads, -1, 2, *tail).swapaxes(1, 2).reshape(weight.shape)


def load_gguf(path: Path, dtype: str, quantization: str | None = None) -> tuple[dict, dict]:
    """Returns (Hugging Face config dict, params) for a GGUF file: tensors dequantized to ``dtype``, or with
    ``quantization="gguf"`` the quantized layers' blocks kept as int8 codes (`gguf_blocks`). `gguf_model_config`
    makes the ModelConfig of the dict."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = gguf_architecture(reader)
    hf_config = gguf_hf_config(reader)
    config = gguf_model_config(hf_config)
    moe = config.num_experts is not None
    tensors = {hf_name(t.name, arch, moe): t for t in reader.tensors if hf_name(t.name, arch, moe)}
    experts = ExpertSlices(reader.tensors, arch, config.num_experts or 0)
    split_kv_b = SplitKvB(reader.tensors, path)
    rows = _RowFixes(arch, config)

    def tensor(name: str):
        if name not in tensors:
            raise ValueError(f"GGUF file {path} lacks the tensor for {name}")
        return tensors[name]

    def get(name: str) -> np.ndarray:
        if name in experts:
            return experts.get(name)
        if name in split_kv_b:
            return split_kv_b.get(name)
        return rows.fix(name, dequantize_tensor(tensor(name)))

    if quantization != "gguf":
        return hf_config, params_from_hf(get, config, dtype)
    if moe:
        raise ValueError(grouped_experts_refusal("gguf"))
    config = gguf_model_config(hf_config, quantization)
    return hf_config, params_from_hf(get, config, dtype, GgufBlocks(get, tensor, rows))


class _RowFixes:
    """What llama.cpp changed in a tensor's rows, undone: Llama's q/k rotary permutation, Gemma's 1 + norm weight,
    Qwen2-MoE's shared-expert gate flattened."""

    def __init__(self, arch: str, config: ModelConfig):
        self.arch, self.config = arch, config

    def fix(self, name: str, array: np.ndarray) -> np.ndarray:
        if name.endswith("shared_expert_gate.weight"):
            return array.reshape(1, -1)  # llama.cpp keeps Qwen2-MoE's [1, hidden] gate as [hidden]
        if self.arch == "llama" and ".q_proj." in name:
            return unpermute_qk(array, self.config.num_heads)
        if self.arch == "llama" and ".k_proj." in name:
            return unpermute_qk(array, self.config.num_kv_heads)
        if self.arch in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            return array - 1.0  # llama.cpp's converter stored 1 + weight
        return array


class GgufBlocks:
    """The `params_from_hf` view of a GGUF file served with quantization="gguf": the quantized layers' kernels as
    int8 codes with group scales and offsets (rows fixed as the float ones are), every other tensor as float."""

    def __init__(self, get, tensor, rows: _RowFixes):
        self.float, self._tensor, self._rows = get, tensor, rows

    def quantized(self, name: str, scheme) -> QuantizedTensor:
        blocks = grouped_codes(self._tensor(name), dequantize_tensor)
        return QuantizedTensor(*(self._rows.fix(name, part) for part in blocks))


class ExpertSlices:
    """One expert's weight out of a layer's stacked GGUF tensor, by Hugging Face name. `convert.py` asks for a
    layer's experts one after another, so the last stack dequantized is kept and each stack is dequantized once."""

    def __init__(self, gguf_tensors, arch: str, num_experts: int):
        self._where = {
            name: (tensor, e) for tensor in gguf_tensors
            for e, name in enumerate(expert_names(tensor.name, arch, num_experts))
        }
        self._stack_name, self._stack = None, None

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        tensor, expert = self._where[name]
        if tensor.name != self._stack_name:
            self._stack_name, self._stack = tensor.name, dequantize_tensor(tensor)
        return self._stack[expert]


class SplitKvB:
    """DeepSeek's kv_b_proj ([heads * (nope + v), rank]) put back together where a GGUF file has llama.cpp's split
    of it instead of `attn_kv_b`: `attn_k_b`, each head's key rows transposed ([heads, rank, nope]), and `attn_v_b`
    ([heads, v, rank])."""

    _NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight")

    def __init__(self, gguf_tensors, path: Path):
        self._tensors, self._path = {t.name: t for t in gguf_tensors}, path

    def __contains__(self, name: str) -> bool:
        match = self._NAME.fullmatch(name)
        return match is not None and f"blk.{match.group(1)}.attn_kv_b.weight" not in self._tensors

    def get(self, name: str) -> np.ndarray:
        layer = self._NAME.fullmatch(name).group(1)
        parts = [f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"]
        if any(part not in self._tensors for part in parts):
            raise ValueError(f"GGUF file {self._path} lacks the tensors for {name}: blk.{layer}.attn_kv_b.weight, "
                             f"or {parts[0]} and {parts[1]}")
        k_b, v_b = (dequantize_tensor(self._tensors[part]) for part in parts)
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [heads, nope + v, rank]
        return kv_b.reshape(-1, kv_b.shape[-1])
