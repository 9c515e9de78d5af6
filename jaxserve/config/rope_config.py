"""Rotary position embeddings as a model's config gives them: base, scaling type and factors.

Place in the data flow: `ModelConfig.from_hf` (`model_config.py`) reads a `RopeConfig` from a Hugging Face
`config.json` (both the `rope_theta` + `rope_scaling` and the `rope_parameters` layouts), the GGUF and orbax
loaders (`jaxserve.weights`) build one from their metadata, and `jaxserve.models.rotary` turns it into the
cos and sin tables the decoder layers apply.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SLIDING_LAYER = "sliding_attention"  # transformers' `layer_types` entry of a sliding-window layer
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's early configs name LongRoPE "su"
CONTEXT_EXTENSION_ROPE_TYPES = ("longrope", "yarn")  # default factor and attention factor from the extension
ROPE_FACTOR_FIELDS = ("short_factor", "long_factor", "frequency_factors")  # one entry per rotary frequency


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
