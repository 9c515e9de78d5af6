"""DeepSeek's block-wise float8 checkpoints, dequantized at load.

Place in the data flow: the safetensors loader (`safetensors_dir.py`) reads a weight stored as float8 e4m3 `<name>`
with `<name>_scale_inv` beside it (the checkpoint's `quantization_config`: `"quant_method": "fp8"` with
`weight_block_size`, DeepSeek-V3/R1's and Kimi K2's official weights) through `dequantize_fp8_blocks`, which gives
the float weight transformers' `finegrained_fp8` computes: every block of `weight_block_size` (rows, columns) of the
`[out, in]` weight is multiplied by its scale. The converter then treats it as a float checkpoint's (keeping float8
weights as stored, for the fp8 scheme's matmuls, is left to a later step).
"""

from __future__ import annotations

from typing import Any

import numpy as np

QUANT_METHOD = "fp8"
SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) of a block-wise float8 checkpoint's scales, None for any other checkpoint."""
    config = hf_config.get("quantization_config") or {}
    if config.get("quant_method") != QUANT_METHOD or not config.get("weight_block_size"):
        return None
    rows, columns = config["weight_block_size"]
    return int(rows), int(columns)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def dequantize_fp8_blocks(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 ``values * scale_inv`` for ``values`` [out, in] (float8) and ``scale_inv`` [ceil(out / rows),
    ceil(in / columns)]: each block of rows x columns scaled by its entry (a partial last block too)."""
    out_features, in_features = values.shape
    rows, columns = block
    expected = (-(-out_features // rows), -(-in_features // columns))
    if scale_inv.shape != expected:
        raise ValueError(f"float8 weight {values.shape} in blocks of {block} needs scales {expected}, "
                         f"got {scale_inv.shape}")
    scales = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), rows, axis=0), columns, axis=1)
    return values.astype(np.float32) * scales[:out_features, :in_features]
