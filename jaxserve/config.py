"""Frozen configuration dataclasses.

`ModelConfig` describes the network (read from a Hugging Face config.json or GGUF metadata by
`jaxserve.weights`); the engine-side configs build on it. Everything is validated in `__post_init__`
so that a bad value fails where it is given, with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OPTForCausalLM": "opt",
    "GPT2LMHeadModel": "gpt2",
}
LEARNED_POSITION_FAMILIES = ("opt", "gpt2")  # absolute position tables instead of rotary embeddings
GEMMA_FAMILIES = ("gemma2", "gemma3")  # (1 + weight) norms, norms around attention and MLP, scaled embeddings
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3")  # an RMSNorm over each head of q and k before rotary
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")  # sparse mixture-of-experts MLPs
SLIDING_LAYER = "sliding_attention"  # transformers' `layer_types` entry of a sliding-window layer
SUPPORTED_ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's early configs name LongRoPE "su"
CONTEXT_EXTENSION_ROPE_TYPES = ("longrope", "yarn")  # default factor and attention factor from the extension
ROPE_FACTOR_FIELDS = ("short_factor", "long_factor", "frequency_factors")  # one entry per rotary frequency
SUPPORTED_DTYPES = ("float32", "bfloat16")  # what weights and the KV pool are stored in
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)  # "auto": bfloat16 where a bf16 matrix unit exists (precision.py)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] | None = None  # longrope: each frequency's divisor within the original context
    long_factor: tuple[float, ...] | None = None  # ... and past it
    attention_factor: float = 1.0  # cos and sin are multiplied by it (longrope's and yarn's defaults: `from_hf`)
    long_context: bool = False  # longrope: the long factors; `ModelConfig.for_max_model_len` decides
    beta_fast: float = 32.0  # yarn: frequencies rotating more than this often in the original context keep theirs
    beta_slow: float = 1.0  # ... less than this often are interpolated by `factor`; a ramp between
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    # llama.cpp's `rope_freqs` tensor (Llama 3.1 and later GGUFs): each frequency divided by its factor, the
    # llama3 scaling precomputed (the GGUF loader's `frequency_factors` key)
    frequency_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        for name in ROPE_FACTOR_FIELDS:  # tuples, also from JSON lists (orbax checkpoints)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _floats(getattr(self, name)))
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope scaling needs both short_factor and long_factor in the rope parameters")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
        """Reads the old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) HF layouts, the latter
        also keyed by layer type (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`)."""
        params = dict(hf.get("rope_parameters") or {})
        if layer_type in params or SLIDING_LAYER in params:
            params = dict(params.get(layer_type) or {})
        scaling = hf.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
        # transformers' rule: Phi-3 keeps the pretraining length beside the rope parameters, and it wins
        original = hf.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        if rope_type not in ("llama3", *CONTEXT_EXTENSION_ROPE_TYPES):
            original = cls.original_max_position_embeddings  # unused: keep configs of equal models equal
        longrope = rope_type == "longrope"
        # longrope and yarn without a factor: the ratio of the extended context to the pretraining one
        factor = params.get("factor") or (hf.get("max_position_embeddings", original) / int(original)
                                          if rope_type in CONTEXT_EXTENSION_ROPE_TYPES else 1.0)
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
            short_factor=_floats(params.get("short_factor")) if longrope else None,
            long_factor=_floats(params.get("long_factor")) if longrope else None,
            attention_factor=_attention_factor(rope_type, params, float(factor), int(original)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            frequency_factors=_floats(params.get("frequency_factors")),
        )

    @classmethod
    def local_from_hf(cls, hf: dict[str, Any]) -> RopeConfig | None:
        """Gemma 3's rotary embedding of its sliding-window layers (another base, never scaled), or None."""
        params = hf.get("rope_parameters") or {}
        if SLIDING_LAYER in params:
            return cls.from_hf(hf, SLIDING_LAYER)
        if "rope_local_base_freq" in hf:
            return cls(theta=float(hf["rope_local_base_freq"]))
        return None


def _floats(values) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def _attention_factor(rope_type: str, params: dict[str, Any], factor: float, original: int) -> float:
    """The scale of cos and sin, transformers' defaults for a context extended `factor` times: LongRoPE
    sqrt(1 + ln(s) / ln(original)), YaRN 0.1 ln(s) + 1 (DeepSeek's mscale / mscale_all_dim ratio where given),
    1 where the context is not extended and for the other rope types."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if rope_type not in CONTEXT_EXTENSION_ROPE_TYPES or factor <= 1.0:
        return 1.0
    if rope_type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0)
    return 0.1 * math.log(factor) + 1.0


# ----- quantization ------------------------------------------------------------------------------------------
# Schemes (weights per output channel, symmetric, except "gguf"'s groups; activations, where quantized, per token at
# run time), applied by `jaxserve.quantization`:
# - "int8": int8 weights, activations in the model's dtype (W8A16); the weight is converted inside the product
#   and its scale applied to the float32 result.
# - "int8_w8a8": int8 weights and activations, an int8 x int8 product accumulating in int32, both scales applied
#   to the result (TPU v5e/v6e, GPUs, CPUs with VNNI or AMX-INT8 multiply int8 natively).
# - "fp8": float8 e4m3 weights; activations in float8 too where the matrix unit multiplies float8 (NVIDIA compute
#   capability 8.9 and later), elsewhere in the model's dtype as "int8" does (vLLM's "fp8" falls back the same way).
# - "gguf" (vLLM's name for serving a GGUF file's quantized weights): int8 codes with a scale and an offset per
#   GGUF_GROUP_SIZE inputs of each output channel, the file's Q8_0, Q4/Q5_0/_1 and Q4/Q5_K blocks exactly as stored
#   (`weights.gguf_blocks`); activations in the model's dtype, the products per group off CPU
#   (`QuantScheme.group_products`), the weight rebuilt inside the step on CPU.
QUANTIZATION_CHOICES = ("int8", "int8_w8a8", "fp8", "gguf")
GGUF_GROUP_SIZE = 32
# what the KV cache stores (vLLM's names): "auto" the model's dtype; "fp8" (= "fp8_e4m3") float8 e4m3, scale 1 (or a
# checkpoint's per layer); "int8" (= vLLM's "int8_per_token_head") int8 with a float32 scale per token and kv head
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "int8", "int8_per_token_head")
KV_SCALE_NAMES = ("k_scale", "v_scale")  # a layer's float8 K/V scales from a checkpoint (`self_attn.k_scale`)

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """`name` (one of QUANTIZATION_CHOICES), the stored weight type and whether activations are quantized too."""

    name: str
    weight_dtype: str  # "int8" or "float8_e4m3fn"
    quantize_activations: bool
    # None: one scale per output channel (symmetric); n: a scale and an offset per n inputs of an output channel
    group_size: int | None = None
    # grouped weights: each group's product on its int8 codes, scaled after (TPU, GPU: no rebuilt matrix in HBM),
    # or the weight rebuilt before one product (CPU, whose dot on groups of 32 is slow); set by `for_platform`
    group_products: bool = False

    @property
    def weight_jnp_dtype(self) -> Any:
        import jax.numpy as jnp  # configuration imports without jax

        return jnp.dtype(self.weight_dtype)

    @property
    def max_value(self) -> float:
        """The largest magnitude of the stored type: a channel's largest weight maps to it."""
        return INT8_MAX if self.weight_dtype == "int8" else FP8_E4M3_MAX

    def for_platform(self, platform: str, compute_capability: str | None = None) -> QuantScheme:
        """The scheme as it runs on ``platform`` ("cpu", "tpu", "cuda"/"gpu"): "fp8" quantizes activations only
        where the matrix unit takes float8 operands; a grouped scheme multiplies group by group off CPU."""
        if self.group_size:
            return dataclasses.replace(self, group_products=platform != "cpu")
        if self.name != "fp8":
            return self
        return dataclasses.replace(self, quantize_activations=has_fp8_matrix_unit(platform, compute_capability))


def has_fp8_matrix_unit(platform: str, compute_capability: str | None) -> bool:
    """NVIDIA GPUs of compute capability 8.9 (Ada) and later multiply float8 natively; TPUs before v7, and CPUs,
    do not."""
    if platform not in ("cuda", "gpu") or not compute_capability:
        return False
    major, _, minor = compute_capability.partition(".")
    return (int(major), int(minor or 0)) >= (8, 9)


def parse_quantization(name: str | None) -> QuantScheme | None:
    """The scheme `name` selects (None: no quantization); a ValueError naming the choices otherwise."""
    if name is None:
        return None
    if name == "int8":
        return QuantScheme("int8", "int8", quantize_activations=False)
    if name == "int8_w8a8":
        return QuantScheme("int8_w8a8", "int8", quantize_activations=True)
    if name == "fp8":
        return QuantScheme("fp8", "float8_e4m3fn", quantize_activations=True)
    if name == "gguf":
        return QuantScheme("gguf", "int8", quantize_activations=False, group_size=GGUF_GROUP_SIZE)
    raise ValueError(f"unsupported quantization {name!r}; supported: {', '.join(QUANTIZATION_CHOICES)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder: the rotary families (Llama 2/3, Mistral, Qwen2/3, SmolLM2, Phi-3, Gemma 2/3,
    and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE), OPT or GPT-2.

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
        """The leading features of each head that rotary embeddings rotate (all of them but for Phi-4-mini)."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        fields = _rotary_fields(hf, family)
        if family in GEMMA_FAMILIES:
            fields.update(_gemma_fields(hf, family))
        if family in MOE_FAMILIES:
            fields.update(_moe_fields(hf, family))
        return cls(architecture=arch, **fields)


def _rotary_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields every rotary family reads (transformers' defaults where a key is absent)."""
    num_heads = hf["num_attention_heads"]
    rope_parameters = hf.get("rope_parameters") or {}
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope=RopeConfig.from_hf(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", family in ("qwen2", "qwen2_moe")))),
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


def _config_dict(value: object, option: str) -> dict:
    """A dict-valued option as a dict: given as one, or as a JSON object (the command line's); errors name it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{option}: not a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a dict or a JSON object, got {type(value).__name__}")
    return value


# -- KV cache events ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """`kv_events_config`: vLLM's `KVEventsConfig` keys and defaults (`--kv-events-config '{...}'`): the engine
    publishes the blocks its prefix cache stores and evicts for KV-aware routers (`engine/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard host (or is ipc/inproc), else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config: {key} must be a positive integer, got {value!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kv_events_config: {key} must be a string, got {getattr(self, key)!r}")

    @property
    def publishes(self) -> bool:
        """Whether events are published: enabled, and not to the "null" publisher."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def for_rank(self, data_parallel_rank: int) -> KVEventsConfig:
        """Data-parallel replica ``rank``'s endpoints, as vLLM offsets them: a TCP port plus the rank (a port the
        system picks, 0 or *, stays so)."""
        if data_parallel_rank == 0:
            return self
        replay = self.replay_endpoint
        return dataclasses.replace(self, endpoint=_offset_port(self.endpoint, data_parallel_rank),
                                   replay_endpoint=None if replay is None else _offset_port(replay, data_parallel_rank))

    @classmethod
    def parse(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = _config_dict(value, "kv_events_config")
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known)}")
        return cls(**value)

def _offset_port(endpoint: str, offset: int) -> str:
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, port = endpoint.rsplit(":", 1)
    return endpoint if port in ("0", "*") else f"{host}:{int(port) + offset}"


# -- speculative decoding ----------------------------------------------------------------------------

METHODS = ("ngram", "draft_model", "suffix")
# vLLM's other methods, and why they are not served here
UNSUPPORTED_METHODS = {
    "eagle": "EAGLE heads need trained weights that jaxserve cannot load yet",
    "eagle3": "EAGLE-3 heads need trained weights that jaxserve cannot load yet",
    "mtp": "multi-token prediction heads are not loaded by jaxserve's model families yet",
    "medusa": "Medusa heads are not supported",
    "mlp_speculator": "MLP speculators are not supported",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
# Rows in a step past which no row gets drafts: decode on this CPU is compute-bound from 8 rows up, where
# verifying a draft costs what a decoded token does (docs/benchmarks/speculative.md measures the crossover)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# vLLM's suffix decoding defaults (Arctic Inference's); num_speculative_tokens defaults to the tree depth
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}
METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("model",),
               "suffix": tuple(SUFFIX_DEFAULTS)}
KNOWN_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size",
              *(key for keys in METHOD_KEYS.values() for key in keys))


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config`: what `LLM(..., speculative_config={...})` and `jaxserve serve --speculative-config '{...}'`
    take, with vLLM's keys. The engine builds its proposer from it (`jaxserve/speculative/`), the grid makes room
    in its mixed buckets for the drafts' sample positions (`EngineConfig.speculative_grid`).

    ``num_speculative_tokens`` drafts at most per row and step; ``disable_by_batch_size``: a step with more
    decoding rows than this speculates for none of them (vLLM V0's option of that name; V1 has none).
    ``method`` "ngram" looks drafts up in the sequence (``prompt_lookup_min/max``); "draft_model" (the method
    when only ``model`` is given, as in vLLM) runs the small model at ``model``, of the target's vocabulary;
    "suffix" follows frequency-counted suffix tries of the sequence and of earlier responses (the
    ``suffix_decoding_*`` keys, `jaxserve/speculative/suffix.py`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model (method "draft_model"): what `LLM(model=...)` takes
    # method "suffix": tries at most this deep (match + drafts), responses of this many finished sequences kept,
    # at most factor x match length drafts, drafts while their estimated probability is at least min_token_prob
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(config) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(KNOWN_KEYS)}")
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        if method in UNSUPPORTED_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not supported: {UNSUPPORTED_METHODS[method]}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        _check_method_keys(method, config)
        suffix = {key: config.get(key, default) for key, default in SUFFIX_DEFAULTS.items()}
        num_speculative_tokens = config.get("num_speculative_tokens")
        if num_speculative_tokens is None and method == "suffix":
            num_speculative_tokens = suffix["suffix_decoding_max_tree_depth"]  # vLLM's default for suffix
        if num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        low, high = low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP  # vLLM's rule
        return cls(method, num_speculative_tokens, low, high,
                   config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE), config.get("model"), **suffix)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: itself, a dict, or a JSON object (the command line's)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = _config_dict(value, "speculative_config")
        return cls.from_dict(value)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                     "suffix_decoding_max_tree_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        self._check_suffix_numbers()
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not (isinstance(self.model, str | os.PathLike) and str(self.model)):
            raise ValueError(f"speculative_config: method 'draft_model' needs the draft's path in 'model', got "
                             f"{self.model!r}")


    def _check_suffix_numbers(self) -> None:
        cached, factor = self.suffix_decoding_max_cached_requests, self.suffix_decoding_max_spec_factor
        probability = self.suffix_decoding_min_token_prob
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, got "
                             f"{cached!r}")
        if not _is_number(factor) or not factor > 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be a number > 0, got "
                             f"{factor!r}")
        if not _is_number(probability) or not 0 <= probability <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be a number in [0, 1], got "
                             f"{probability!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_method_keys(method: str, config: dict[str, Any]) -> None:
    """A key of another method is a mistake worth naming (vLLM ignores it)."""
    for other, keys in METHOD_KEYS.items():
        given = [key for key in keys if other != method and config.get(key) is not None]
        if given:
            raise ValueError(f"speculative_config: {', '.join(map(repr, given))} apply to method {other!r}, not "
                             f"{method!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `jaxserve serve` take, with vLLM's names.

    `None` means "derive": `max_model_len` from the model and the largest context bucket,
    `max_num_seqs` from the largest decode bucket, `max_num_batched_tokens` from the largest prefill
    bucket, `block_size` from the bucket file, and `num_kv_blocks` from the memory budget.
    `tensor_parallel_size` devices (of all hosts, after `distributed_init`) hold one engine, its weights and
    KV pool split by attention heads (see `jaxserve.distributed.sharding` and `jaxserve.distributed.multihost`).
    `compile_cache_dir` is JAX's persistent compilation cache, where warm-up loads and stores executables:
    None (the default) is ``$JAXSERVE_COMPILE_CACHE_DIR`` if set (empty: disabled), else the per-user
    ``~/.cache/jaxserve/compile_cache``; a path overrides; ``""`` disables it. The value is kept as given and
    resolved when the engine starts (`jaxserve.compilation.compile_cache.resolve_cache_dir`).
    `strict_no_compile` turns a compilation after warm-up into a RuntimeError (vLLM TPU's check).
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    buckets: str | None = None
    seed: int = 0
    attention_backend: str = "auto"
    waiting_served_ratio: float | None = None
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs; None: on TPU/GPU, off on CPU
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas behind one server (engine_core/data_parallel.py)
    data_parallel_rank: int = 0  # this engine's replica: its devices and its KV events' port offset
    distributed_init: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    compile_cache_dir: str | None = None  # None: the per-user default; "": disabled (compilation/compile_cache.py)
    strict_no_compile: bool = False  # raise if anything compiles after warm-up
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    enable_prefix_caching: bool = True  # reuse cached KV blocks of repeated prompt prefixes (vLLM's default)
    disable_log_stats: bool = False  # no periodic stats line (throughput, queues, KV usage, prefix hit rate)
    max_itl_ms: float | None = None  # latency target of steps with decode rows (core/step_budget.py); None: none
    # speculative decoding (vLLM's dict, or its JSON: `SpeculativeConfig`); None: off
    speculative_config: SpeculativeConfig | dict | str | None = None
    # KV cache events for KV-aware routers (vLLM's dict, or its JSON: `KVEventsConfig`); None: none published
    kv_events_config: KVEventsConfig | dict | str | None = None
    # weights quantized at load: "int8", "int8_w8a8" or "fp8"; "gguf": a GGUF file's blocks kept (jaxserve.quantization)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8 e4m3; "int8": scaled int8 (kv_cache.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPE_CHOICES)}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.data_parallel_rank, int) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}) "
                             f"(data_parallel_size), got {self.data_parallel_rank!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        if self.max_itl_ms is not None and (isinstance(self.max_itl_ms, bool) or not self.max_itl_ms > 0):
            raise ValueError(f"max_itl_ms must be a positive number of milliseconds, got {self.max_itl_ms!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.compile_cache_dir is not None:  # "" is allowed: no persistent cache
            if not isinstance(self.compile_cache_dir, str | os.PathLike):
                raise ValueError(f"compile_cache_dir must be a directory path, got {self.compile_cache_dir!r}")
            object.__setattr__(self, "compile_cache_dir", os.fspath(self.compile_cache_dir))
        for name in ("strict_no_compile", "enable_prefix_caching", "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        parse_quantization(self.quantization)  # a ValueError naming the schemes
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (auto), got {self.async_scheduling!r}")

    @property
    def speculative_grid(self) -> tuple[int, int] | None:
        """(most drafts per row, most rows with drafts) that the mixed buckets make room for; None: no speculation."""
        spec = self.speculative_config
        return None if spec is None else (spec.num_speculative_tokens, spec.disable_by_batch_size)
