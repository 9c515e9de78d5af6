"""gpt-oss's mxfp4 expert checkpoints, dequantized at load (OCP microscaling FP4).

Place in the data flow: the safetensors loader (`safetensors_dir.py`) reads an expert projection stored as
`<name>_blocks` and `<name>_scales` (the checkpoint's `quantization_config` says `"quant_method": "mxfp4"`) through
`dequantize_mxfp4`, which gives the float tensor transformers would have saved as `<name>`, `[experts, in, out]`;
the converter then treats it like any float checkpoint's. Every 32 values share one scale: a block of 16 bytes holds
32 e2m1 values (two per byte, the low nibble first), the scale is an e8m0 exponent, 2^(scale - 127).
"""

from __future__ import annotations

import numpy as np

QUANT_METHOD = "mxfp4"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# the 16 e2m1 values by their 4-bit code: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def packed_names(name: str) -> tuple[str, str]:
    """The two tensors an mxfp4 checkpoint stores for the float tensor ``name``."""
    return name + BLOCKS_SUFFIX, name + SCALES_SUFFIX


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, G * 32, out]`` from ``blocks`` uint8 ``[E, out, G, 16]`` and ``scales`` uint8 ``[E, out, G]``
    (transformers' `convert_moe_packed_tensors`: the stored rows are the output features, so the result is
    transposed to the `[experts, in, out]` of its float `gate_up_proj` and `down_proj`)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {blocks.shape} and scales {scales.shape} do not match: every 16 bytes of "
                         "blocks take one scale")
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    num_experts, out_features = blocks.shape[:2]
    return np.ascontiguousarray(values.reshape(num_experts, out_features, -1).transpose(0, 2, 1))
