"""What Gemma 4's text decoder adds to `ModelConfig`, read from its `config.json` (no JAX).

Place in the data flow: `ModelConfig.from_hf` reads these fields for the gemma4 family (`gemma4_fields`); the model
(`jaxserve.models.gemma4`), the weight loader (`jaxserve.weights.convert`) and the KV cache layout read them.

Gemma 4 (transformers' `Gemma4TextConfig`) differs from Gemma 3 in ways no other family has, so they live here:
- per-layer attention shapes: the full-attention layers' `global_head_dim` and kv heads (`per_layer_config` in a
  saved config) beside the sliding layers' `head_dim`; `attention_k_eq_v`: a full layer's V is its K projection;
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V and read the cache of the last earlier layer
  of their type (transformers' "reuse" and "store" layers); with `use_double_wide_mlp` their MLP is twice as wide;
- per-layer input embeddings (PLE, `hidden_size_per_layer_input`), a MoE block beside the dense MLP
  (`enable_moe_block`), and the full layers' "proportional" rotary embedding (a fraction of each head's
  frequencies rotate, over the whole head dim).
"""

from __future__ import annotations

import dataclasses
from typing import Any

FULL_LAYER = "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma4Layers:
    """Per-layer shapes and Gemma 4's extra blocks (module docstring). Tuples have one entry per layer."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    k_eq_v: tuple[bool, ...]  # V is the K projection (no v_proj)
    kv_sources: tuple[int, ...]  # the layer whose cache each layer reads (itself unless it shares)
    intermediate_sizes: tuple[int, ...]  # the dense MLP's width
    per_layer_input_size: int = 0  # PLE's width per layer (0: none)
    vocab_size_per_layer_input: int = 0
    num_experts: int = 0  # the MoE block beside the dense MLP (0: none)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    full_rope_theta: float = 1_000_000.0  # the full layers' proportional rotary embedding
    full_partial_rotary_factor: float = 0.25
    full_rope_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise ValueError(f"top_k_experts ({self.top_k_experts}) must be in [1, num_experts ({self.num_experts})]")

    @property
    def readers(self) -> tuple[tuple[int, int], ...]:
        """(layer, source) of every layer that reads another's cache."""
        return tuple((layer, source) for layer, source in enumerate(self.kv_sources) if source != layer)

    @property
    def page_shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct (kv heads, head_dim) of the layers' caches, in layer order."""
        return tuple(dict.fromkeys(zip(self.kv_heads, self.head_dims, strict=True)))

    @property
    def layer_kinds(self) -> tuple[int, ...]:
        """Per layer: its page shape's index in `page_shapes`."""
        shapes = self.page_shapes
        return tuple(shapes.index(shape) for shape in zip(self.kv_heads, self.head_dims, strict=True))


def gemma4_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Gemma 4 text config (`Gemma4TextConfig`, or a `Gemma4Config`'s `text_config`)."""
    if hf.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention='all' attends to later tokens, which a decoder "
                         "serving from a causal KV cache cannot do: it is not supported")
    num_layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else FULL_LAYER for i in range(num_layers)])
    layer_types[-1] = FULL_LAYER  # transformers forces the last layer to full attention
    head_dim = hf.get("head_dim", 256)
    kv_heads = hf.get("num_key_value_heads", 4)
    overrides = _per_layer_overrides(hf, layer_types)
    head_dims = tuple(overrides.get(i, {}).get("head_dim", head_dim) for i in range(num_layers))
    kv_heads_per_layer = tuple(overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(num_layers))
    sources = _kv_sources(layer_types, int(hf.get("num_kv_shared_layers") or 0))
    intermediate = hf.get("intermediate_size", 9216)
    double_wide = bool(hf.get("use_double_wide_mlp", False))
    full_rope = (hf.get("rope_parameters") or {}).get(FULL_LAYER) or {}
    if full_rope.get("rope_type", "proportional") not in ("proportional", "default"):
        raise ValueError(f"unsupported Gemma 4 full-attention rope type {full_rope.get('rope_type')!r}")
    moe = bool(hf.get("enable_moe_block", False))
    layers = Gemma4Layers(
        head_dims=head_dims,
        kv_heads=kv_heads_per_layer,
        k_eq_v=tuple(bool(hf.get("attention_k_eq_v", False)) and kind == FULL_LAYER for kind in layer_types),
        kv_sources=sources,
        intermediate_sizes=tuple(intermediate * (2 if double_wide and sources[i] != i else 1)
                                 for i in range(num_layers)),
        per_layer_input_size=int(hf.get("hidden_size_per_layer_input") or 0),
        vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input") or hf.get("vocab_size", 0)),
        num_experts=int(hf.get("num_experts") or 0) if moe else 0,
        top_k_experts=int(hf.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0) if moe else 0,
        full_rope_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        full_partial_rotary_factor=float(full_rope.get("partial_rotary_factor", 0.25)
                                         if full_rope.get("rope_type", "proportional") == "proportional" else 1.0),
        full_rope_factor=float(full_rope.get("factor", 1.0)),
    )
    return dict(
        layer_types=tuple(layer_types), head_dim=head_dim, num_kv_heads=kv_heads, gemma4=layers,
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh", rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=True,
        sliding_window=hf.get("sliding_window", 512), final_logit_softcap=hf.get("final_logit_softcapping"),
        max_position_embeddings=hf.get("max_position_embeddings", 131_072),
    )


def _per_layer_overrides(hf: dict[str, Any], layer_types: list[str]) -> dict[int, dict[str, int]]:
    """The full layers' head_dim and kv heads: a saved config's `per_layer_config` (string keys), else the
    `global_head_dim` / `num_global_key_value_heads` arguments transformers turns into it (the kv heads only with
    `attention_k_eq_v`, as transformers does)."""
    if hf.get("per_layer_config") is not None:
        return {int(layer): dict(values) for layer, values in hf["per_layer_config"].items()}
    overrides = {"head_dim": hf.get("global_head_dim", 512)}
    if hf.get("attention_k_eq_v", False) and hf.get("num_global_key_value_heads") is not None:
        overrides["num_key_value_heads"] = hf["num_global_key_value_heads"]
    return {layer: overrides for layer, kind in enumerate(layer_types) if kind == FULL_LAYER}


def _kv_sources(layer_types: list[str], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it attends to: the last `num_shared` layers read the last earlier layer of
    their type (transformers' `kv_sharing_modes`), every other layer its own."""
    num_layers = len(layer_types)
    if not num_shared:
        return tuple(range(num_layers))
    first_shared = num_layers - num_shared
    if first_shared < 1:
        raise ValueError(f"num_kv_shared_layers ({num_shared}) leaves no layer computing K/V of its own")
    stores = {kind: max(i for i in range(first_shared) if layer_types[i] == kind)
              for kind in set(layer_types[:first_shared])}
    missing = sorted(set(layer_types[first_shared:]) - set(stores))
    if missing:
        raise ValueError(f"KV-shared layers of type {missing} have no earlier layer of that type to read")
    return tuple(layer if layer < first_shared else stores[layer_types[layer]] for layer in range(num_layers))
