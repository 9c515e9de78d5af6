"""The network a checkpoint holds: `ModelConfig`, read from a Hugging Face `config.json` family by family.

Place in the data flow: the weight loaders (`jaxserve.weights`) build a `ModelConfig` from a checkpoint's
config (`ModelConfig.from_hf`; the GGUF and orbax loaders from their metadata), the engine adds the
quantization scheme and the serving length (`for_max_model_len`), and the models (`jaxserve.models`), the
sharding and the compilation plan read it. Everything is validated in `__post_init__` so that a bad value
fails where it is given, with a message naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config.gemma4_config import Gemma4Layers, gemma4_fields
from jaxserve.config.kv_cache_groups import KVCacheLayout, layout_for
from jaxserve.config.mla_config import MLAConfig, mla_fields
from jaxserve.config.quantization_config import QuantScheme
from jaxserve.config.qwen3_next_config import (
    QWEN3_NEXT_ARCHITECTURES,
    QWEN3_NEXT_FAMILIES,
    qwen3_next_fields,
    qwen3_next_hf,
)
from jaxserve.config.rope_config import ROPE_FACTOR_FIELDS, SLIDING_LAYER, RopeConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its text decoder (`model.language_model.`)
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # and Kimi K2
    "OPTForCausalLM": "opt",
    "GPT2LMHeadModel": "gpt2",
    **QWEN3_NEXT_ARCHITECTURES,  # full-attention layers only (`qwen3_next_config.py`)
}
# checkpoints of a multimodal model: the text config under `text_config`, the text weights under `model.language_model.`
TEXT_CONFIG_ARCHITECTURES = ("Gemma4ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                             "Qwen3_5MoeForConditionalGeneration")
LEARNED_POSITION_FAMILIES = ("opt", "gpt2")  # absolute position tables instead of rotary embeddings
GEMMA_FAMILIES = ("gemma2", "gemma3")  # (1 + weight) norms, norms around attention and MLP, scaled embeddings
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3")  # an RMSNorm over each head of q and k before rotary
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")  # sparse mixture-of-experts MLPs
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, DeepSeek's MoE (`mla_config.py`)
# families whose o_proj has a bias when attention_bias is set (transformers'; Qwen2's and Mistral's never has one)
OUT_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt_oss")
ATTENTION_LAYER_TYPES = (SLIDING_LAYER, "full_attention")  # transformers' layer_types the engine serves
SUPPORTED_ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: the rotary families (Llama 2/3, Mistral, Qwen2/3, SmolLM2, Phi-3, Gemma 2/3,
    the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Qwen3-Next / Qwen3.5 full-attention), OPT, GPT-2.

    Rotary families share one decoder (`jaxserve.models.llama`, Gemma's in `jaxserve.models.gemma`); the
    fields after `hidden_act` switch on what a family adds. `layer_types` lists transformers' per-layer
    attention ("sliding_attention" or "full_attention"); None means every layer slides when `sliding_window`
    is set. The fields after `eos_token_id` only matter to OPT and GPT-2.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    local_rope: RopeConfig | None = None  # Gemma 3: the rotary embedding of sliding-window layers
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rotary over the first part of each head only
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: attention scores c * tanh(s / c)
    final_logit_softcap: float | None = None  # Gemma 2: vocabulary logits c * tanh(l / c)
    num_experts: int | None = None  # mixture-of-experts families: routed experts per MoE layer
    num_experts_per_tok: int = 0  # top-k experts of every token
    moe_intermediate_size: int = 0  # hidden size of one expert's MLP
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum 1
    decoder_sparse_step: int = 1  # Qwen-MoE: every this-many-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE: a gated dense expert every token takes
    attention_out_bias: bool = False  # o_proj has a bias too (attention_bias in OUT_BIAS_FAMILIES)
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax's denominator
    expert_bias: bool = False  # gpt-oss: the router and the experts' projections have biases
    swiglu: tuple[float, float] | None = None  # gpt-oss: the experts' clamped SwiGLU (alpha, limit)
    attn_output_gate: bool = False  # Qwen3-Next / 3.5: q_proj gives each head a gate too; out * sigmoid(gate)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    layer_norm_eps: float = 1e-5
    layer_norm_affine: bool = True  # OPT's layer_norm_elementwise_affine: False means no scale and bias
    mlp_bias: bool = False
    pre_norm: bool = True  # OPT-350m normalises after each residual add (do_layer_norm_before=False)
    final_norm: bool = True  # a norm after the last layer
    word_embed_proj_dim: int | None = None  # OPT: embeddings narrower than hidden_size, projected in and out
    scale_attn_weights: bool = True  # GPT-2: scores divided by sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2: scores also divided by (layer + 1)
    # weights quantized at load (`jaxserve.quantization`): set by the engine from EngineConfig.quantization
    quantization: QuantScheme | None = None
    # the checkpoint gives each layer a float8 scale for K and one for V (`self_attn.k_scale` / `v_scale`,
    # compressed-tensors' kv_cache_scheme): K/V are stored divided by them (`models.common.Attention`)
    kv_cache_scales: bool = False
    gemma4: Gemma4Layers | None = None  # Gemma 4's per-layer shapes, KV sharing, PLE and MoE block
    mla: MLAConfig | None = None  # DeepSeek's latent attention (the pool: one kv head of the latent) and routing
    # sliding-window layers in KV cache groups of their own, which keep only their window
    # (`config/kv_cache_groups.py`); set by the engine from EngineConfig.disable_hybrid_kv_cache_manager
    hybrid_kv_cache: bool = True

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.uses_rope and self.rotary_dim % 2:
            raise ValueError(f"the rotary dimension must be even, got {self.rotary_dim} (head_dim {self.head_dim})")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
        unknown = sorted(set(self.layer_types or ()) - set(ATTENTION_LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer types {unknown}: the engine serves {', '.join(ATTENTION_LAYER_TYPES)}")
        for name in ROPE_FACTOR_FIELDS:
            factors = getattr(self.rope, name)
            if factors is not None and len(factors) != self.rotary_dim // 2:
                raise ValueError(
                    f"rope {name} has {len(factors)} entries; the rotary dimension {self.rotary_dim} needs "
                    f"{self.rotary_dim // 2}"
                )
        if self.num_experts is not None and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts ({self.num_experts})]"
            )

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def uses_rope(self) -> bool:
        return self.family not in LEARNED_POSITION_FAMILIES

    @property
    def rotary_dim(self) -> int:
        """The leading features of each head that rotary embeddings rotate (all of them but for Phi-4-mini; MLA's
        rotary part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def output_hidden_size(self) -> int:
        """The width of the final hidden states, what the lm head reads (OPT may project them out narrower)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend over the last `sliding_window` tokens only."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(kind == SLIDING_LAYER for kind in self.layer_types)

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache groups of this model's layers: which block table and pool row each layer uses."""
        if self.gemma4 is None:
            return layout_for(self.sliding_layers, self.sliding_window, hybrid=self.hybrid_kv_cache)
        return layout_for(self.sliding_layers, self.sliding_window, hybrid=self.hybrid_kv_cache,
                          layer_kinds=self.gemma4.layer_kinds, readers=self.gemma4.readers)

    @property
    def kv_values_in_keys(self) -> bool:
        """The pool keeps keys only, the values a prefix of them (MLA's latent): no V pages."""
        return self.mla is not None

    @property
    def kv_page_shapes(self) -> tuple[tuple[int, int], ...]:
        """(kv heads, head_dim) of each kind of the pool (`KVCacheLayout.layer_kinds`): one, but for Gemma 4."""
        return self.gemma4.page_shapes if self.gemma4 is not None else ((self.num_kv_heads, self.head_dim),)

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: is its MLP a sparse mixture of experts (transformers' Qwen-MoE rule; Mixtral: all)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return tuple(
            i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers)
        )

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config as an engine serving up to `max_model_len` tokens runs it. LongRoPE (Phi-3, Phi-4-mini)
        picks its factors once, as vLLM does: the long ones when `max_model_len` exceeds the pretraining
        context, else the short ones. transformers switches per forward pass instead (long once the sequence
        passes that context), which an engine cannot do without recomputing the cached keys; the two agree
        whenever no sequence of a long-context engine stays within the original context."""
        if self.rope.rope_type != "longrope":
            return self
        long_context = max_model_len > self.rope.original_max_position_embeddings
        return dataclasses.replace(self, rope=dataclasses.replace(self.rope, long_context=long_context))

    @property
    def mixes_mlp_kinds(self) -> bool:
        """Some layers sparse, some dense (Qwen-MoE's `mlp_only_layers`, `decoder_sparse_step` > 1): such a
        model's layers are unrolled, each with its own parameters (`common.layer_stack`)."""
        return len(set(self.sparse_layers)) > 1

    @property
    def unrolled_layers(self) -> bool:
        """Whether the layers' weights cannot stack (`mixes_mlp_kinds`, Gemma 4's per-layer shapes): one subtree of
        parameters per layer, the layers unrolled."""
        return self.mixes_mlp_kinds or self.gemma4 is not None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds the config from a Hugging Face `config.json` dict."""
        architectures = hf.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {architectures or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "opt":
            return cls(architecture=arch, **_opt_fields(hf))
        if family == "gpt2":
            return cls(architecture=arch, **_gpt2_fields(hf))
        if arch in TEXT_CONFIG_ARCHITECTURES:
            hf = {**hf, **hf.get("text_config", {})}
        if family in QWEN3_NEXT_FAMILIES:
            hf = qwen3_next_hf(hf, family)
        fields = _rotary_fields(hf, family)
        if family in GEMMA_FAMILIES:
            fields.update(_gemma_fields(hf, family))
        if family == "gemma4":
            fields.update(gemma4_fields(hf))
        if family in MLA_FAMILIES:
            fields.update(mla_fields(hf, family))
        if family in MOE_FAMILIES:
            fields.update(_moe_fields(hf, family))
        if family == "gpt_oss":
            fields.update(_gpt_oss_fields(hf))
        if family in QWEN3_NEXT_FAMILIES:
            fields.update(qwen3_next_fields(hf, family))
        return cls(architecture=arch, **fields)


def _rotary_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields every rotary family reads (transformers' defaults where a key is absent)."""
    num_heads = hf["num_attention_heads"]
    rope_parameters = hf.get("rope_parameters") or {}
    attention_bias = bool(hf.get("attention_bias", hf.get("qkv_bias", family in ("qwen2", "qwen2_moe"))))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        # Gemma 4's full layers' rotary embedding is `Gemma4Layers`'
        rope=RopeConfig.from_hf(hf, SLIDING_LAYER if family == "gemma4" else "full_attention"),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias and family in OUT_BIAS_FAMILIES,
        sliding_window=_sliding_window(hf, family),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
        layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else None,
        partial_rotary_factor=float(rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        qk_norm=family in QK_NORM_FAMILIES,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos_ids(hf.get("eos_token_id")),
    )


def _sliding_window(hf: dict[str, Any], family: str) -> int | None:
    """Qwen's configs carry a window they use only with `use_sliding_window`."""
    if family.startswith("qwen") and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window")


def _gemma_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2 and 3: the window alternates per layer (transformers' default patterns when `layer_types` is
    absent: Gemma 2 every other layer from the first, Gemma 3 five sliding layers to one global)."""
    num_layers = hf["num_hidden_layers"]
    pattern = 2 if family == "gemma2" else int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    default_types = tuple(SLIDING_LAYER if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    return dict(
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else default_types,
        local_rope=RopeConfig.local_from_hf(hf) if family == "gemma3" else None,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def _moe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Mixtral (`num_local_experts`, top-k renormalised) and Qwen-MoE (`num_experts`, `norm_topk_prob`)."""
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        norm_topk_prob=True if family == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") if family == "qwen2_moe" else None,
    )


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: biases on the router and the experts (its attention_bias covers every attention projection);
    attention sinks; the experts' clamped SwiGLU. Its top-k weights are a softmax over the k chosen logits: the
    renormalised top k of a softmax over all of them."""
    return dict(attention_sinks=True, expert_bias=True, norm_topk_prob=True,
                swiglu=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))))


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _opt_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """OPTConfig (transformers' defaults where a key is absent): MHA, ReLU, learned positions."""
    hidden, num_heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    pre_norm = bool(hf.get("do_layer_norm_before", True))
    bias = bool(hf.get("enable_bias", True))
    proj_dim = hf.get("word_embed_proj_dim") or hidden
    return dict(
        vocab_size=hf.get("vocab_size", 50272), hidden_size=hidden, intermediate_size=hf.get("ffn_dim", 3072),
        num_layers=hf.get("num_hidden_layers", 12), num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=hidden // num_heads, max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), attention_bias=bias, mlp_bias=bias,
        hidden_act=hf.get("activation_function", "relu"), bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=_eos_ids(hf.get("eos_token_id", 2)),
        layer_norm_affine=bool(hf.get("layer_norm_elementwise_affine", True)), pre_norm=pre_norm,
        final_norm=pre_norm and not hf.get("_remove_final_layer_norm", False),
        word_embed_proj_dim=None if proj_dim == hidden else proj_dim,
    )


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config (its n_* names, transformers' defaults where a key is absent)."""
    if hf.get("add_cross_attention", False):
        raise ValueError("GPT-2 models with cross-attention (add_cross_attention=true) are not supported")
    hidden, num_heads = hf.get("n_embd", 768), hf.get("n_head", 12)
    return dict(
        vocab_size=hf.get("vocab_size", 50257), hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf.get("n_layer", 12), num_heads=num_heads, num_kv_heads=num_heads, head_dim=hidden // num_heads,
        max_position_embeddings=hf.get("n_positions", 1024),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), attention_bias=True, mlp_bias=True,
        hidden_act=hf.get("activation_function", "gelu_new"), bos_token_id=hf.get("bos_token_id", 50256),
        eos_token_id=_eos_ids(hf.get("eos_token_id", 50256)),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        scale_attn_weights=bool(hf.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
    )
