"""Frozen configuration dataclasses.

`ModelConfig` describes the network (read from a Hugging Face config.json or GGUF metadata by
`jaxserve.weights`); the engine-side configs build on it. Everything is validated in `__post_init__`
so that a bad value fails where it is given, with a message naming it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Reads both the old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) HF layouts."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

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
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: 'silu'")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        family = SUPPORTED_ARCHITECTURES[arch]
        sliding_window = hf.get("sliding_window")
        if family == "qwen2" and not hf.get("use_sliding_window", False):
            sliding_window = None
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope=RopeConfig.from_hf(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            sliding_window=sliding_window,
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and `jaxserve serve` take, with vLLM's names.

    `None` means "derive": `max_model_len` from the model and the largest context bucket,
    `max_num_seqs` from the largest decode bucket, `max_num_batched_tokens` from the largest prefill
    bucket, `block_size` from the bucket file, and `num_kv_blocks` from the memory budget.
    `compile_cache_dir` (None: no persistent cache) is where warm-up loads and stores executables;
    `strict_no_compile` turns a compilation after warm-up into a RuntimeError (vLLM TPU's check).
    """

    model: str | None = None
    dtype: str = "float32"
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
    async_scheduling: bool = True  # schedule step N+1 while step N runs; its tokens stay on the device
    compile_cache_dir: str | None = None  # JAX persistent compilation cache (see jaxserve/compile_cache.py)
    strict_no_compile: bool = False  # raise if anything compiles after warm-up

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.compile_cache_dir is not None:
            if not isinstance(self.compile_cache_dir, str | os.PathLike) or not str(self.compile_cache_dir):
                raise ValueError(f"compile_cache_dir must be a directory path, got {self.compile_cache_dir!r}")
            object.__setattr__(self, "compile_cache_dir", os.fspath(self.compile_cache_dir))
        if not isinstance(self.strict_no_compile, bool):
            raise ValueError(f"strict_no_compile must be True or False, got {self.strict_no_compile!r}")
