"""GPT-2 (openai-community/gpt2 and its descendants) in Flax.

GPT-2's block is OPT's pre-norm block exactly: LayerNorm, biased q/k/v/o projections, a two-layer GELU
MLP (`gelu_new`, the tanh approximation), learned absolute positions and a final LayerNorm, with the LM
head tied to the token embeddings. The differences are data, not code: its position table starts at row
0, and its options (`scale_attn_weights`, `scale_attn_by_inverse_layer_idx`) are read from the config by
`common.Attention`. What is GPT-2-specific is the checkpoint layout (Conv1D weights stored `[in, out]`,
q/k/v fused in `c_attn`), handled by `jaxserve.weights.convert`.
"""

from __future__ import annotations

from typing import ClassVar

from jaxserve.models.opt import OPTForCausalLM


class GPT2LMHeadModel(OPTForCausalLM):
    position_offset: ClassVar[int] = 0
