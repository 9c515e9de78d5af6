"""Qwen3-Next and Qwen3.5 (dense and MoE) text configs: what of them the engine serves, as `ModelConfig` fields.

Place in the data flow: `ModelConfig.from_hf` (`model_config.py`) calls `qwen3_next_hf` on the config dict (the
refusals, transformers' defaults these families change) before reading the rotary fields, and merges
`qwen3_next_fields` into them; the rotary decoder (`jaxserve.models.llama`) then runs the gated full attention
(`ModelConfig.attn_output_gate`), the (1 + weight) norms and the MoE with its shared expert.

These models interleave gated DeltaNet linear-attention layers with full-attention ones. The linear layers need a
per-sequence recurrent state that the engine does not keep yet (`jaxserve.models.gated_deltanet` has their math,
unserved), so only configs whose every layer is full attention are served; any other is refused at load.
"""

from __future__ import annotations

from typing import Any

# architecture -> family; the `ForConditionalGeneration` checkpoints keep the text config under `text_config` and
# the text weights under `model.language_model.` (vision weights and the MTP head are not read)
QWEN3_NEXT_ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
}
QWEN3_NEXT_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
LINEAR_ATTENTION = "linear_attention"  # transformers' `layer_types` entry of a gated DeltaNet layer


def qwen3_next_layer_types(hf: dict[str, Any]) -> list[str]:
    """transformers' rule: `layer_types` where given, else every `full_attention_interval`-th layer (default 4)
    full attention, the others linear."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    interval = int(hf.get("full_attention_interval", 4))
    return [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(hf["num_hidden_layers"])]


def qwen3_next_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The config dict with the layer types spelt out and these families' defaults (partial rotary 0.25, rms eps
    1e-6; Qwen3.5-MoE has no dense `intermediate_size`: its experts' stands in, unused), or a ValueError naming
    what the engine cannot serve."""
    layer_types = qwen3_next_layer_types(hf)
    linear = [i for i, kind in enumerate(layer_types) if kind == LINEAR_ATTENTION]
    if linear:
        raise ValueError(
            f"{family}: {len(linear)} of {len(layer_types)} layers are gated DeltaNet linear attention "
            f"(layers {linear}); their per-sequence recurrent-state cache is not implemented yet, so only configs "
            "whose every layer is full_attention are served"
        )
    if hf.get("attention_bias", False):
        raise ValueError(f"{family}: attention_bias=true (biased q/k/v/o projections) is not supported")
    rope_parameters = dict(hf.get("rope_parameters") or {})
    rope_parameters.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    intermediate = hf.get("intermediate_size") or hf.get("moe_intermediate_size", 512)
    return {**hf, "layer_types": layer_types, "rope_parameters": rope_parameters,
            "intermediate_size": intermediate, "rms_norm_eps": hf.get("rms_norm_eps", 1e-6)}


def qwen3_next_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields beyond the rotary ones: q/k norms, the output gate, and the MLPs (Qwen3-Next: MoE where
    `mlp_only_layers` and `decoder_sparse_step` say, with a shared expert; Qwen3.5: dense everywhere; Qwen3.5-MoE:
    MoE everywhere, top-k always renormalised)."""
    fields: dict[str, Any] = dict(qk_norm=True, attn_output_gate=True)
    if family == "qwen3_5_text" or (family == "qwen3_next" and not hf.get("num_experts", 512)):
        return fields
    fields.update(
        num_experts=int(hf.get("num_experts", 512 if family == "qwen3_next" else 256)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 10 if family == "qwen3_next" else 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 512)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 512)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
    )
    if family == "qwen3_next":
        fields.update(decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                      mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    return fields
