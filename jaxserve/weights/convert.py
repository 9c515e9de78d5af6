"""Hugging Face tensor names → the Flax parameter tree of each model family (layers stacked for scan).

Both loaders (safetensors directories and GGUF files) produce tensors under Hugging Face names and
shapes; this module maps them onto the tree, casting to the target dtype. One table per family lists
every parameter with its Hugging Face source and transform, so the names a loader must find and the tree
it builds come from the same place. Linear weights are `[out, in]` in Hugging Face and transposed here;
GPT-2's Conv1D weights are already `[in, out]`, and its fused `c_attn` is split into q, k and v.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxserve.config import ModelConfig

TensorGetter = Callable[[str], np.ndarray]
LAYER = "{i}"  # placeholder for the layer number in per-layer tensor names

# The part of Hugging Face names that belongs to the CausalLM wrapper: hub checkpoints saved from the
# bare model (the original gpt2, opt-*) lack it, and the loaders accept both spellings.
BASE_MODEL_PREFIX = {"opt": "model.", "gpt2": "transformer."}


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """One leaf of the parameter tree: its path under "params", the Hugging Face tensor it is made from
    (with `{i}` for per-layer tensors, stacked on a new leading axis) and the transform applied first."""

    path: tuple[str, ...]
    hf_name: str
    transform: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf_name


def _linear(path: tuple[str, ...], hf_prefix: str, bias: bool) -> list[ParamSource]:
    """A `torch.nn.Linear` ([out, in] weight) as a Flax Dense kernel [in, out] (+ bias)."""
    sources = [ParamSource((*path, "kernel"), f"{hf_prefix}.weight", _transpose)]
    if bias:
        sources.append(ParamSource((*path, "bias"), f"{hf_prefix}.bias"))
    return sources


def _layer_norm(path: tuple[str, ...], hf_prefix: str, affine: bool = True) -> list[ParamSource]:
    if not affine:
        return []
    return [ParamSource((*path, "scale"), f"{hf_prefix}.weight"), ParamSource((*path, "bias"), f"{hf_prefix}.bias")]


def llama_sources(config: ModelConfig) -> list[ParamSource]:
    layer = f"model.layers.{LAYER}"
    sources = [
        ParamSource(("embed_tokens", "embedding"), "model.embed_tokens.weight"),
        ParamSource(("norm", "weight"), "model.norm.weight"),
    ]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        sources.append(ParamSource(("layers", norm, "weight"), f"{layer}.{norm}.weight"))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        bias = config.attention_bias and proj != "o_proj"
        sources += _linear(("layers", "self_attn", proj), f"{layer}.self_attn.{proj}", bias)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        sources += _linear(("layers", "mlp", proj), f"{layer}.mlp.{proj}", False)
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


def opt_sources(config: ModelConfig) -> list[ParamSource]:
    decoder, affine = "model.decoder", config.layer_norm_affine
    layer = f"{decoder}.layers.{LAYER}"
    sources = [
        ParamSource(("embed_tokens", "embedding"), f"{decoder}.embed_tokens.weight"),
        ParamSource(("embed_positions", "embedding"), f"{decoder}.embed_positions.weight"),
        *_layer_norm(("layers", "attn_norm"), f"{layer}.self_attn_layer_norm", affine),
        *_layer_norm(("layers", "mlp_norm"), f"{layer}.final_layer_norm", affine),
    ]
    for proj, hf_proj in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")):
        sources += _linear(("layers", "self_attn", proj), f"{layer}.self_attn.{hf_proj}", config.attention_bias)
    sources += _linear(("layers", "mlp", "up_proj"), f"{layer}.fc1", config.mlp_bias)
    sources += _linear(("layers", "mlp", "down_proj"), f"{layer}.fc2", config.mlp_bias)
    if config.word_embed_proj_dim is not None:
        sources += _linear(("project_in",), f"{decoder}.project_in", False)
        sources += _linear(("project_out",), f"{decoder}.project_out", False)
    if config.final_norm:
        sources += _layer_norm(("norm",), f"{decoder}.final_layer_norm", affine)
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


def _columns(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """Slices the output features of a Conv1D weight [in, out] or bias [out]."""
    return lambda x: x[..., start:stop]


_CONV1D_LEAVES = (("kernel", "weight"), ("bias", "bias"))


def gpt2_sources(config: ModelConfig) -> list[ParamSource]:
    layer, hidden = f"transformer.h.{LAYER}", config.hidden_size
    sources = [
        ParamSource(("embed_tokens", "embedding"), "transformer.wte.weight"),
        ParamSource(("embed_positions", "embedding"), "transformer.wpe.weight"),
        *_layer_norm(("layers", "attn_norm"), f"{layer}.ln_1"),
        *_layer_norm(("layers", "mlp_norm"), f"{layer}.ln_2"),
        *_layer_norm(("norm",), "transformer.ln_f"),
    ]
    for index, proj in enumerate(("q_proj", "k_proj", "v_proj")):  # c_attn: [in, 3 * hidden], q | k | v
        split = _columns(index * hidden, (index + 1) * hidden)
        sources += [
            ParamSource(("layers", "self_attn", proj, "kernel"), f"{layer}.attn.c_attn.weight", split),
            ParamSource(("layers", "self_attn", proj, "bias"), f"{layer}.attn.c_attn.bias", split),
        ]
    for path, hf_prefix in (
        (("layers", "self_attn", "o_proj"), f"{layer}.attn.c_proj"),
        (("layers", "mlp", "up_proj"), f"{layer}.mlp.c_fc"),
        (("layers", "mlp", "down_proj"), f"{layer}.mlp.c_proj"),
    ):  # Conv1D weights are stored [in, out]: Flax's kernel layout already
        sources += [ParamSource((*path, leaf), f"{hf_prefix}.{hf_leaf}") for leaf, hf_leaf in _CONV1D_LEAVES]
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


FAMILY_SOURCES = {
    "llama": llama_sources,
    "mistral": llama_sources,
    "qwen2": llama_sources,
    "opt": opt_sources,
    "gpt2": gpt2_sources,
}


def param_sources(config: ModelConfig) -> list[ParamSource]:
    return FAMILY_SOURCES[config.family](config)


def hf_param_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name the model needs, in a stable order without repeats."""
    names: dict[str, None] = {}
    for source in param_sources(config):
        layers = range(config.num_layers) if source.per_layer else [None]
        for i in layers:
            names[source.hf_name.replace(LAYER, str(i))] = None
    return list(names)


def hf_name_alternatives(name: str, config: ModelConfig) -> list[str]:
    """`name` and, for families whose hub checkpoints omit it, `name` without the wrapper's prefix."""
    prefix = BASE_MODEL_PREFIX.get(config.family)
    if prefix and name.startswith(prefix):
        return [name, name[len(prefix):]]
    return [name]


def params_from_hf(get: TensorGetter, config: ModelConfig, dtype: np.dtype | str) -> dict:
    """Builds `{"params": ...}` for the family's model from tensors fetched by Hugging Face name."""
    np_dtype = _numpy_dtype(dtype)
    params: dict = {}
    for source in param_sources(config):
        transform = source.transform or (lambda x: x)
        if source.per_layer:
            names = [source.hf_name.replace(LAYER, str(i)) for i in range(config.num_layers)]
            value = np.stack([transform(np.asarray(get(name))) for name in names])
        else:
            value = transform(np.asarray(get(source.hf_name)))
        node = params
        for key in source.path[:-1]:
            node = node.setdefault(key, {})
        node[source.path[-1]] = np.asarray(value, dtype=np.float32).astype(np_dtype)
    return {"params": params}


def _numpy_dtype(dtype: np.dtype | str) -> np.dtype:
    if str(dtype) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
