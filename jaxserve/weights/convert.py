"""Hugging Face tensor names → the Flax parameter tree of each model family (layers stacked for scan).

Both loaders (safetensors directories and GGUF files) produce tensors under Hugging Face names and
shapes; this module maps them onto the tree, casting to the target dtype. One table per family lists
every parameter with its Hugging Face source and transform, so the names a loader must find and the tree
it builds come from the same place. Linear weights are `[out, in]` in Hugging Face and transposed here;
GPT-2's Conv1D weights are already `[in, out]`, and its fused `c_attn` is split into q, k and v; Phi-3's fused
`qkv_proj` and `gate_up_proj` are split likewise. Mixture-of-experts weights, one tensor per expert in the
checkpoints, are stacked into `[E, in, out]` arrays (`moe.SparseMoeBlock`'s layout). A model mixing dense and
MoE layers gets one subtree per layer instead (`params["layers"]["0"]`, ...: the unrolled layout), since its
layers' MLPs do not stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxserve.config.model_config import GEMMA_FAMILIES, TEXT_CONFIG_ARCHITECTURES, ModelConfig
from jaxserve.config.quantization_config import KV_SCALE_NAMES
from jaxserve.quantization.weights import GROUP_OFFSET

TensorGetter = Callable[[str], np.ndarray]
LAYER = "{i}"  # placeholder for the layer number in per-layer tensor names
EXPERT = "{e}"  # placeholder for the expert number in per-expert tensor names

# The part of Hugging Face names that belongs to the CausalLM wrapper: hub checkpoints saved from the
# bare model (the original gpt2, opt-*) lack it, and the loaders accept both spellings.
BASE_MODEL_PREFIX = {"opt": "model.", "gpt2": "transformer."}


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """One leaf of the parameter tree: its path under "params", the Hugging Face tensor it is made from
    (with `{i}` for per-layer tensors, stacked on a new leading axis, and `{e}` for per-expert tensors,
    stacked on the axis after it) and the transform applied to each tensor first. `layers`: the layers that
    have this tensor, where not all do (a model mixing dense and MoE layers)."""

    path: tuple[str, ...]
    hf_name: str
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    layers: tuple[int, ...] | None = None

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf_name

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.hf_name


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
    """Llama, Mistral, Qwen2/3, Gemma 2/3 and the MoE families: the rotary decoder's tree."""
    layer = f"model.layers.{LAYER}"
    sources = [
        ParamSource(("embed_tokens", "embedding"), "model.embed_tokens.weight"),
        ParamSource(("norm", "weight"), "model.norm.weight"),
    ]
    for norm in _layer_norm_names(config):
        sources.append(ParamSource(("layers", norm, "weight"), f"{layer}.{norm}.weight"))
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            sources.append(ParamSource(("layers", "self_attn", norm, "weight"), f"{layer}.self_attn.{norm}.weight"))
    if config.family == "phi3":
        sources += _phi3_fused_sources(config, layer)
    else:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            bias = config.attention_bias and (proj != "o_proj" or config.attention_out_bias)
            sources += _linear(("layers", "self_attn", proj), f"{layer}.self_attn.{proj}", bias)
        sources += _mlp_sources(config, layer)
    if config.attention_sinks:
        sources.append(ParamSource(("layers", "self_attn", "sinks"), f"{layer}.self_attn.sinks"))
    if config.kv_cache_scales:
        sources += [ParamSource(("layers", "self_attn", name), f"{layer}.self_attn.{name}", _scalar)
                    for name in KV_SCALE_NAMES]
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


def _layer_norm_names(config: ModelConfig) -> tuple[str, ...]:
    if config.family in GEMMA_FAMILIES:  # norms before and after attention and the MLP
        return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
    return ("input_layernorm", "post_attention_layernorm")


def _gated_mlp(path: tuple[str, ...], hf_prefix: str, names=("gate_proj", "up_proj", "down_proj")) -> list[ParamSource]:
    """A gated MLP whose Hugging Face projections are `names` (gate, up, down) under `hf_prefix`."""
    sources = []
    for proj, hf_proj in zip(("gate_proj", "up_proj", "down_proj"), names, strict=True):
        sources += _linear((*path, proj), f"{hf_prefix}.{hf_proj}", False)
    return sources


def _mlp_sources(config: ModelConfig, layer: str) -> list[ParamSource]:
    """The dense MLP, or the sparse MoE block, or each in its layers where a model mixes them."""
    if config.num_experts is None:
        return _gated_mlp(("layers", "mlp"), f"{layer}.mlp")
    if not config.mixes_mlp_kinds:
        return _moe_sources(config, layer)
    sparse = [i for i, is_sparse in enumerate(config.sparse_layers) if is_sparse]
    dense = [i for i, is_sparse in enumerate(config.sparse_layers) if not is_sparse]
    return [
        *(dataclasses.replace(s, layers=tuple(dense)) for s in _gated_mlp(("layers", "mlp"), f"{layer}.mlp")),
        *(dataclasses.replace(s, layers=tuple(sparse)) for s in _moe_sources(config, layer)),
    ]


def _moe_sources(config: ModelConfig, layer: str) -> list[ParamSource]:
    """The sparse MoE block: router `[H, E]`, experts stacked `[E, in, out]`, Qwen2-MoE's shared expert."""
    if config.family == "gpt_oss":
        return _gpt_oss_moe_sources(f"{layer}.mlp")
    if config.family == "mixtral":
        block, expert_names = f"{layer}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, expert_names = f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")
    sources = [ParamSource(("layers", "mlp", "router", "kernel"), f"{block}.gate.weight", _transpose)]
    for proj, hf_proj in zip(("gate_proj", "up_proj", "down_proj"), expert_names, strict=True):
        name = f"{block}.experts.{EXPERT}.{hf_proj}.weight"
        sources.append(ParamSource(("layers", "mlp", "experts", proj), name, _transpose))
    if config.shared_expert_intermediate_size:  # Qwen2-MoE
        sources += _gated_mlp(("layers", "mlp", "shared_expert"), f"{block}.shared_expert")
        sources += _linear(("layers", "mlp", "shared_expert_gate"), f"{block}.shared_expert_gate", False)
    return sources


def _every_other(first: int) -> Callable[[np.ndarray], np.ndarray]:
    """Columns first, first + 2, ... of the last axis: gpt-oss interleaves gate and up in one `gate_up_proj`."""
    return lambda x: x[..., first::2]


def _gpt_oss_moe_sources(block: str) -> list[ParamSource]:
    """gpt-oss's router (with bias) and its experts, stored stacked `[E, in, out]` already (gate and up
    interleaved in `gate_up_proj`), each projection with a bias `[E, out]`."""
    experts = f"{block}.experts"
    return [
        *_linear(("layers", "mlp", "router"), f"{block}.router", True),
        ParamSource(("layers", "mlp", "experts", "gate_proj"), f"{experts}.gate_up_proj", _every_other(0)),
        ParamSource(("layers", "mlp", "experts", "up_proj"), f"{experts}.gate_up_proj", _every_other(1)),
        ParamSource(("layers", "mlp", "experts", "down_proj"), f"{experts}.down_proj"),
        ParamSource(("layers", "mlp", "experts", "gate_proj_bias"), f"{experts}.gate_up_proj_bias", _every_other(0)),
        ParamSource(("layers", "mlp", "experts", "up_proj_bias"), f"{experts}.gate_up_proj_bias", _every_other(1)),
        ParamSource(("layers", "mlp", "experts", "down_proj_bias"), f"{experts}.down_proj_bias"),
    ]


def _rows(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    """Output features [start, stop) of a fused `torch.nn.Linear` weight [out, in], as a Flax kernel [in, out]."""
    return lambda x: x[start:stop].T


def _phi3_fused_sources(config: ModelConfig, layer: str) -> list[ParamSource]:
    """Phi-3 fuses q, k, v (`qkv_proj`: q | k | v rows) and gate, up (`gate_up_proj`: gate | up rows)."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    qkv = f"{layer}.self_attn.qkv_proj.weight"
    gate_up = f"{layer}.mlp.gate_up_proj.weight"
    return [
        ParamSource(("layers", "self_attn", "q_proj", "kernel"), qkv, _rows(0, q_size)),
        ParamSource(("layers", "self_attn", "k_proj", "kernel"), qkv, _rows(q_size, q_size + kv_size)),
        ParamSource(("layers", "self_attn", "v_proj", "kernel"), qkv, _rows(q_size + kv_size, q_size + 2 * kv_size)),
        *_linear(("layers", "self_attn", "o_proj"), f"{layer}.self_attn.o_proj", False),
        ParamSource(("layers", "mlp", "gate_proj", "kernel"), gate_up, _rows(0, inter)),
        ParamSource(("layers", "mlp", "up_proj", "kernel"), gate_up, _rows(inter, 2 * inter)),
        *_linear(("layers", "mlp", "down_proj"), f"{layer}.mlp.down_proj", False),
    ]


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


def gemma4_sources(config: ModelConfig) -> list[ParamSource]:
    """Gemma 4's text decoder (`models/gemma4.py`), one subtree per layer: only the layers with a cache of their own
    have k_proj and k_norm (the KV-sharing ones' checkpoint keys are ignored, as transformers does), and only those
    whose V is not their K a v_proj; the MoE block's router and experts sit beside the layer's MLP."""
    layer, layers = f"model.layers.{LAYER}", config.gemma4
    owners = tuple(i for i, source in enumerate(layers.kv_sources) if source == i)
    with_v = tuple(i for i in owners if not layers.k_eq_v[i])
    norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    sources = [
        ParamSource(("embed_tokens", "embedding"), "model.embed_tokens.weight"),
        ParamSource(("norm", "weight"), "model.norm.weight"),
        ParamSource(("layers", "layer_scalar"), f"{layer}.layer_scalar"),
        ParamSource(("layers", "self_attn", "q_norm", "weight"), f"{layer}.self_attn.q_norm.weight"),
        ParamSource(("layers", "self_attn", "k_norm", "weight"), f"{layer}.self_attn.k_norm.weight", layers=owners),
        *_linear(("layers", "self_attn", "q_proj"), f"{layer}.self_attn.q_proj", False),
        *(dataclasses.replace(s, layers=owners) for s in _linear(("layers", "self_attn", "k_proj"),
                                                                 f"{layer}.self_attn.k_proj", False)),
        *(dataclasses.replace(s, layers=with_v) for s in _linear(("layers", "self_attn", "v_proj"),
                                                                 f"{layer}.self_attn.v_proj", False)),
        *_linear(("layers", "self_attn", "o_proj"), f"{layer}.self_attn.o_proj", False),
        *_gated_mlp(("layers", "mlp"), f"{layer}.mlp"),
    ]
    if layers.num_experts:
        norms += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"]
        sources += _gemma4_moe_sources(layer, layers.moe_intermediate_size)
    if layers.per_layer_input_size:
        norms.append("post_per_layer_input_norm")
        sources += [
            ParamSource(("embed_tokens_per_layer", "embedding"), "model.embed_tokens_per_layer.weight"),
            *_linear(("per_layer_model_projection",), "model.per_layer_model_projection", False),
            ParamSource(("per_layer_projection_norm", "weight"), "model.per_layer_projection_norm.weight"),
            *_linear(("layers", "per_layer_input_gate"), f"{layer}.per_layer_input_gate", False),
            *_linear(("layers", "per_layer_projection"), f"{layer}.per_layer_projection", False),
        ]
    sources += [ParamSource(("layers", norm, "weight"), f"{layer}.{norm}.weight") for norm in norms]
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


def _gemma4_moe_sources(layer: str, intermediate: int) -> list[ParamSource]:
    """Gemma 4's router (`proj` [E, H], `scale` [H], `per_expert_scale` [E]) and its experts stored stacked:
    `gate_up_proj` [E, 2I, H] (gate rows first), `down_proj` [E, H, I]; as `moe.ExpertWeights`' [E, in, out]."""
    gate_up = f"{layer}.experts.gate_up_proj"
    return [
        *_linear(("layers", "router", "proj"), f"{layer}.router.proj", False),
        ParamSource(("layers", "router", "scale"), f"{layer}.router.scale"),
        ParamSource(("layers", "router", "per_expert_scale"), f"{layer}.router.per_expert_scale"),
        ParamSource(("layers", "experts", "gate_proj"), gate_up, lambda x: x[:, :intermediate].transpose(0, 2, 1)),
        ParamSource(("layers", "experts", "up_proj"), gate_up, lambda x: x[:, intermediate:].transpose(0, 2, 1)),
        ParamSource(("layers", "experts", "down_proj"), f"{layer}.experts.down_proj", lambda x: x.transpose(0, 2, 1)),
    ]


def deepseek_sources(config: ModelConfig) -> list[ParamSource]:
    """DeepSeek-V2 / V3 (`models/deepseek.py`): latent attention, whose rotary rows are permuted from the
    checkpoints' interleaved pairs to rotate-half (`_rope_rows`), dense MLPs in the first `first_k_dense_replace`
    layers and MoE blocks after them (router `gate`, V3's correction bias, experts stacked, shared experts)."""
    layer, mla = f"model.layers.{LAYER}", config.mla
    attn = f"{layer}.self_attn"
    per_head = _rope_rows(config.num_heads, mla.qk_head_dim, mla.qk_nope_head_dim, mla.qk_rope_head_dim)
    latent = _rope_rows(1, mla.latent_dim, mla.kv_lora_rank, mla.qk_rope_head_dim)
    bias = config.attention_bias
    sources = [
        ParamSource(("embed_tokens", "embedding"), "model.embed_tokens.weight"),
        ParamSource(("norm", "weight"), "model.norm.weight"),
        *(ParamSource(("layers", norm, "weight"), f"{layer}.{norm}.weight")
          for norm in ("input_layernorm", "post_attention_layernorm")),
        ParamSource(("layers", "self_attn", "kv_a_proj_with_mqa", "kernel"), f"{attn}.kv_a_proj_with_mqa.weight",
                    lambda x: latent(x).T),
        ParamSource(("layers", "self_attn", "kv_a_layernorm", "weight"), f"{attn}.kv_a_layernorm.weight"),
        *_linear(("layers", "self_attn", "kv_b_proj"), f"{attn}.kv_b_proj", False),
        *_linear(("layers", "self_attn", "o_proj"), f"{attn}.o_proj", bias),
    ]
    if bias:
        sources.append(ParamSource(("layers", "self_attn", "kv_a_proj_with_mqa", "bias"),
                                   f"{attn}.kv_a_proj_with_mqa.bias", latent))
    if mla.q_lora_rank is None:
        sources.append(ParamSource(("layers", "self_attn", "q_proj", "kernel"), f"{attn}.q_proj.weight",
                                   lambda x: per_head(x).T))
    else:
        sources += [
            *_linear(("layers", "self_attn", "q_a_proj"), f"{attn}.q_a_proj", bias),
            ParamSource(("layers", "self_attn", "q_a_layernorm", "weight"), f"{attn}.q_a_layernorm.weight"),
            ParamSource(("layers", "self_attn", "q_b_proj", "kernel"), f"{attn}.q_b_proj.weight",
                        lambda x: per_head(x).T),
        ]
    sources += _deepseek_mlp_sources(config, layer)
    if not config.tie_word_embeddings:
        sources += _linear(("lm_head",), "lm_head", False)
    return sources


def _rope_rows(heads: int, head_dim: int, first: int, rotary: int) -> Callable[[np.ndarray], np.ndarray]:
    """A weight's (or bias's) output rows with each head's rotary part [first, first + rotary) reordered from
    interleaved pairs (0, 1), (2, 3), ... to rotate-half halves: rows first + (0, 2, 4, ..., 1, 3, 5, ...)."""
    order = np.concatenate([np.arange(0, rotary, 2), np.arange(1, rotary, 2)])
    rows = np.arange(heads * head_dim).reshape(heads, head_dim)
    rows[:, first:] = rows[:, first + order]
    return lambda x: x[rows.reshape(-1)]


def _deepseek_mlp_sources(config: ModelConfig, layer: str) -> list[ParamSource]:
    dense = tuple(i for i, sparse in enumerate(config.sparse_layers) if not sparse)
    sparse = tuple(i for i, is_sparse in enumerate(config.sparse_layers) if is_sparse)
    sources = [dataclasses.replace(s, layers=dense) for s in _gated_mlp(("layers", "mlp"), f"{layer}.mlp") if dense]
    if not sparse:
        return sources
    moe = [
        ParamSource(("layers", "mlp", "gate", "kernel"), f"{layer}.mlp.gate.weight", _transpose),
        *_gated_mlp(("layers", "mlp", "shared_experts"), f"{layer}.mlp.shared_experts"),
        *(ParamSource(("layers", "mlp", "experts", proj), f"{layer}.mlp.experts.{EXPERT}.{proj}.weight", _transpose)
          for proj in ("gate_proj", "up_proj", "down_proj")),
    ]
    if not config.mla.n_shared_experts:
        moe = [s for s in moe if "shared_experts" not in s.path]
    if config.mla.correction_bias:
        moe.append(ParamSource(("layers", "mlp", "gate", "e_score_correction_bias"),
                               f"{layer}.mlp.gate.e_score_correction_bias"))
    return sources + [dataclasses.replace(s, layers=sparse if dense else None) for s in moe]


FAMILY_SOURCES = {"opt": opt_sources, "gpt2": gpt2_sources, "gemma4": gemma4_sources,
                  "deepseek_v2": deepseek_sources, "deepseek_v3": deepseek_sources}  # others: llama_sources


def param_sources(config: ModelConfig) -> list[ParamSource]:
    if config.kv_cache_scales and config.family in FAMILY_SOURCES:
        raise ValueError(f"float8 K/V scales (kv_cache_scheme) are read for the rotary families, not {config.family}")
    return FAMILY_SOURCES.get(config.family, llama_sources)(config)


def _scalar(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).reshape(())


def _source_layers(source: ParamSource, config: ModelConfig) -> list[int]:
    """The layers a per-layer leaf is read for."""
    return list(range(config.num_layers)) if source.layers is None else list(source.layers)


def _tensor_names(source: ParamSource, config: ModelConfig) -> list[list[str]]:
    """The Hugging Face names of one leaf: per layer (one row for a global tensor), per expert within it."""
    layers = [str(i) for i in _source_layers(source, config)] if source.per_layer else [""]
    experts = [str(e) for e in range(config.num_experts or 0)] if source.per_expert else [""]
    return [[source.hf_name.replace(LAYER, i).replace(EXPERT, e) for e in experts] for i in layers]


def hf_param_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name the model needs, in a stable order without repeats."""
    names: dict[str, None] = {}
    for source in param_sources(config):
        for layer_names in _tensor_names(source, config):
            names.update(dict.fromkeys(layer_names))
    return list(names)


def hf_name_alternatives(name: str, config: ModelConfig) -> list[str]:
    """`name` and, for families whose hub checkpoints omit it, `name` without the wrapper's prefix."""
    if config.architecture in TEXT_CONFIG_ARCHITECTURES and name.startswith("model."):
        return [name.replace("model.", "model.language_model.", 1), name]
    prefix = BASE_MODEL_PREFIX.get(config.family)
    if prefix and name.startswith(prefix):
        return [name, name[len(prefix):]]
    return [name]


def params_from_hf(get: TensorGetter, config: ModelConfig, dtype: np.dtype | str, tensors=None) -> dict:
    """Builds `{"params": ...}` for the family's model from tensors fetched by Hugging Face name.

    ``tensors`` (a checkpoint stored quantized, ``config.quantization`` its scheme: a
    `compressed_tensors.CheckpointTensors`, or a GGUF file's blocks): the quantized kernels keep their stored values
    and get their scales (and a grouped scheme's offsets) beside them; every other leaf is read as float
    (dequantized where the checkpoint quantized it)."""
    from jaxserve.weights.compressed_tensors import is_quantized_leaf

    np_dtype = _numpy_dtype(dtype)
    read_float = get if tensors is None else tensors.float
    params: dict = {}
    for source in param_sources(config):
        if tensors is not None and config.quantization is not None and is_quantized_leaf(source.path):
            _put_quantized(params, source, config, tensors)
            continue
        transform = source.transform or (lambda x: x)
        stack = np.stack if source.per_expert else (lambda arrays: arrays[0])

        def leaf(names: list[str], transform=transform, stack=stack) -> np.ndarray:
            value = stack([transform(np.asarray(read_float(name))) for name in names])
            return np.asarray(value, dtype=np.float32).astype(np_dtype)

        _put_layers(params, source, config, [leaf(names) for names in _tensor_names(source, config)])
    return {"params": params}


def _put_quantized(params: dict, source: ParamSource, config: ModelConfig, tensors) -> None:
    """A quantized leaf as stored: [out, in] values transposed (or split) like a float kernel, and beside them the
    scales (f32[out], or f32[out, groups] with offsets) through the same transform, so that they keep their rows."""
    from jaxserve.weights.compressed_tensors import scale_path

    transform = source.transform or (lambda x: x)
    stack = np.stack if source.per_expert else (lambda arrays: arrays[0])
    layers = [[tensors.quantized(name, config.quantization) for name in names]
              for names in _tensor_names(source, config)]
    _put_layers(params, source, config, [stack([transform(t.values) for t in layer]) for layer in layers])
    grouped = layers[0][0].offset is not None
    parts = {scale_path(source.path, grouped): lambda t: _scale_rows(transform, t.scale)}
    if grouped:
        parts[(*source.path[:-1], GROUP_OFFSET)] = lambda t: transform(t.offset)
    for path, part in parts.items():
        values = [stack([part(t) for t in layer]) for layer in layers]
        _put_layers(params, dataclasses.replace(source, path=path), config, values)


def _scale_rows(transform, scale: np.ndarray) -> np.ndarray:
    """A kernel's scales through its source's transform: per output channel (f32[out]), a transpose leaves them
    as they are and a row split (a fused projection's part) takes the same rows; grouped ([out, groups]) they
    transform as the kernel does."""
    return transform(scale) if scale.ndim == 2 else transform(scale[:, None]).reshape(-1)


def _put_layers(params: dict, source: ParamSource, config: ModelConfig, layer_values: list[np.ndarray]) -> None:
    """One leaf's values (one per layer, or one for a global tensor) into the tree: stacked for the layers'
    scan, or one subtree per layer where a model mixes MLP kinds (module docstring)."""
    if not source.per_layer:
        _put(params, source.path, layer_values[0])
    elif config.unrolled_layers:
        for i, value in zip(_source_layers(source, config), layer_values, strict=True):
            _put(params, (source.path[0], str(i), *source.path[1:]), value)
    else:
        _put(params, source.path, np.stack(layer_values))


def _put(tree: dict, path: tuple[str, ...], value: np.ndarray) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _numpy_dtype(dtype: np.dtype | str) -> np.dtype:
    if str(dtype) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
