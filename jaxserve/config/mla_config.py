"""What DeepSeek-V2/V3 (and Kimi K2) add to `ModelConfig`: multi-head latent attention and DeepSeek's MoE routing,
read from a `config.json` (no JAX).

Place in the data flow: `ModelConfig.from_hf` reads these fields for the deepseek families (`mla_fields`); the model
(`jaxserve.models.deepseek`), the weight loader (`jaxserve.weights.convert`) and the KV sizing read them.

Multi-head latent attention (MLA): each token's keys and values are rebuilt from one compressed latent c
(`kv_lora_rank`) and one rotary key k_pe shared by every head (`qk_rope_head_dim`). The engine caches only
[c | k_pe] per token and layer, one "kv head" of kv_lora_rank + qk_rope_head_dim values whose first kv_lora_rank are
also the value (`ModelConfig.kv_values_in_keys`), and attends in the weight-absorbed form: each head's query is
projected into the latent space, and the latent output back out through the value projection.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

TPU_LANES = 128  # a TPU tile's minor dimension
PREFILL_FORMS = ("expanded", "absorbed")
ROUTING_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")  # V3's sigmoid with bias; V2's softmax ones


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The attention's ranks and head dims, and the MoE routing of the deepseek families."""

    kv_lora_rank: int  # r: the latent's width
    qk_nope_head_dim: int  # dn: the position-free part of each head's query and key
    qk_rope_head_dim: int  # dr: the rotary part (one key for all heads)
    v_head_dim: int  # dv
    q_lora_rank: int | None = None  # low-rank queries (V3, Kimi K2); None: one q_proj (V2-Lite)
    rope_interleave: bool = True  # the rotary part's pairs interleaved in the checkpoint (permuted at load)
    softmax_mscale: float = 1.0  # m: the softmax scale is qk_head_dim^-0.5 * m^2 (YaRN's mscale_all_dim)
    routing: str = "noaux_tc"  # one of ROUTING_METHODS
    n_group: int = 1  # experts in this many groups, ...
    topk_group: int = 1  # ... the tokens' experts from this many of them
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    correction_bias: bool = True  # V3: a per-expert bias added to the scores for selection only
    # how prefill steps attend (`models/mla_expanded.py`): "expanded" (the measured faster) or "absorbed" as decode
    prefill_form: str = "expanded"

    def __post_init__(self) -> None:
        if self.prefill_form not in PREFILL_FORMS:
            raise ValueError(f"prefill_form must be one of {PREFILL_FORMS}, got {self.prefill_form!r}")
        if self.routing not in ROUTING_METHODS:
            raise ValueError(f"unsupported DeepSeek topk_method {self.routing!r}; "
                             f"supported: {', '.join(ROUTING_METHODS)}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.softmax_mscale**2


def latent_row_width(latent_dim: int, platform: str) -> int:
    """Values per row of the latent pool on ``platform``: the latent and rotary key, on TPU padded with zeros to
    whole 128-lane tiles (a pool of 576-value rows is stored padded to 640 lanes, and XLA copies the whole pool into
    that layout for every in-place write of a step: measured deviceless on v6e, twice the pool's bytes)."""
    return -(-latent_dim // TPU_LANES) * TPU_LANES if platform == "tpu" else latent_dim


def mla_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """`ModelConfig` fields of a DeepSeek-V2 / V3 config: the pool's one kv head of the latent's width, the MoE
    fields (the first `first_k_dense_replace` layers dense) and the `MLAConfig`."""
    if hf.get("num_nextn_predict_layers") and hf.get("num_nextn_predict_layers") < 0:
        raise ValueError("num_nextn_predict_layers must be >= 0")
    v3 = family == "deepseek_v3"
    routing = "noaux_tc" if v3 else hf.get("topk_method", "greedy")
    num_layers = hf["num_hidden_layers"]
    mla = MLAConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=hf.get("q_lora_rank"), rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        softmax_mscale=_softmax_mscale(hf), routing=routing,
        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(hf.get("n_shared_experts") or 0), correction_bias=v3,
    )
    if mla.routing != "greedy" and mla.n_group and hf.get("n_routed_experts", 0) % mla.n_group:
        raise ValueError(f"n_routed_experts ({hf.get('n_routed_experts')}) is not divisible by n_group ({mla.n_group})")
    dense_layers = min(int(hf.get("first_k_dense_replace") or 0), num_layers)
    experts = hf.get("n_routed_experts")
    return dict(
        mla=mla, num_kv_heads=1, head_dim=mla.latent_dim,
        num_experts=int(experts) if experts else None,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) and v3,  # V2 never renormalises
        mlp_only_layers=tuple(range(dense_layers)) if experts else (),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _softmax_mscale(hf: dict[str, Any]) -> float:
    """YaRN's m = 0.1 * mscale_all_dim * ln(factor) + 1 (transformers' DeepSeek attention), 1 without YaRN."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor, mscale_all_dim = float(params.get("factor") or 1.0), params.get("mscale_all_dim")
    if rope_type == "default" or not mscale_all_dim or factor <= 1.0:
        return 1.0
    return 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
