"""Hugging Face tensor names → the Flax parameter tree of `LlamaForCausalLM` (layers stacked for scan).

Both loaders (safetensors directories and GGUF files) produce tensors under Hugging Face names and
shapes (`[out, in]` linear weights); this module transposes and stacks them, casting to the target dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxserve.config import ModelConfig

TensorGetter = Callable[[str], np.ndarray]

_LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_NORMS = ("input_layernorm", "post_attention_layernorm")


def hf_param_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name the model needs."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        names += [f"{prefix}.{norm}.weight" for norm in _NORMS]
        for block, projs in _LINEARS.items():
            names += [f"{prefix}.{block}.{proj}.weight" for proj in projs]
        if config.attention_bias:
            names += [f"{prefix}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    return names


def params_from_hf(get: TensorGetter, config: ModelConfig, dtype: np.dtype | str) -> dict:
    """Builds `{"params": ...}` for `LlamaForCausalLM` from tensors fetched by Hugging Face name."""
    np_dtype = _numpy_dtype(dtype)

    def cast(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32).astype(np_dtype)

    def stacked(suffix: str, transpose: bool = False) -> np.ndarray:
        arrays = [np.asarray(get(f"model.layers.{i}.{suffix}")) for i in range(config.num_layers)]
        return cast(np.stack([a.T if transpose else a for a in arrays]))

    layers: dict = {norm: {"weight": stacked(f"{norm}.weight")} for norm in _NORMS}
    for block, projs in _LINEARS.items():
        layers[block] = {p: {"kernel": stacked(f"{block}.{p}.weight", transpose=True)} for p in projs}
    if config.attention_bias:
        for p in ("q_proj", "k_proj", "v_proj"):
            layers["self_attn"][p]["bias"] = stacked(f"self_attn.{p}.bias")
    params = {
        "embed_tokens": {"embedding": cast(get("model.embed_tokens.weight"))},
        "layers": layers,
        "norm": {"weight": cast(get("model.norm.weight"))},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = {"kernel": cast(np.asarray(get("lm_head.weight")).T)}
    return {"params": params}


def _numpy_dtype(dtype: np.dtype | str) -> np.dtype:
    if str(dtype) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
