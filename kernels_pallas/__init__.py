"""Pallas paged-attention kernels for jaxserve (TPU via Mosaic, GPU via Triton).

The engine's attention backend calls these once per layer with the stacked KV pool and the layer index (read
in place; on TPU in the lane-dense layout of ``_common.PoolGeometry``):
``paged_attention`` for decode steps, ``prefill_attention`` for (chunked) prefill, and
``ragged_paged_attention`` for mixed steps whose flat batch holds decode rows and prefill chunks together;
``mla_decode_attention`` for decode steps of a latent (MLA) model over its pool of latents.
Each reads float32 / bfloat16 pools, float8 e4m3 pools (the float8 KV cache) and int8 pools with a float32
scale per token and kv head (the int8 KV cache: ``k_scales`` / ``v_scales``, see ``_common``).
"""

from kernels_pallas.mla_attention import mla_decode_attention, mla_decode_attention_reference
from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from kernels_pallas.prefill_attention import prefill_attention, prefill_attention_reference
from kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = [
    "mla_decode_attention",
    "mla_decode_attention_reference",
    "paged_attention",
    "paged_attention_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
