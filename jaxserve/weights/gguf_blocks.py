"""A GGUF file's quantized blocks as int8 codes with a scale and an offset per 32 weights (`quantization="gguf"`).

Place in the data flow: `gguf_file.load_gguf` asks `grouped_codes` for each kernel the schemes quantize when the
engine serves the file's blocks as stored; the codes, scales and offsets become a `Linear`'s `kernel`, `group_scale`
and `group_offset` (`jaxserve.quantization`), so a step rebuilds the file's own weights, never a float copy in HBM.

Kept exactly (codes * scale + offset is the value `gguf`'s dequantizer gives, bit for bit):
  Q8_0  32 int8 q, f16 d per block              w = d q            codes q,       scale d,      offset 0
  Q4_0  32 4-bit q, f16 d                       w = d (q - 8)      codes q - 8,   scale d,      offset 0
  Q4_1  32 4-bit q, f16 d and m                 w = d q + m        codes q,       scale d,      offset m
  Q5_0  32 5-bit q (fifth bits in a uint32)     w = d (q - 16)     codes q - 16,  scale d,      offset 0
  Q5_1  32 5-bit q, f16 d and m                 w = d q + m        codes q,       scale d,      offset m
  Q4_K, Q5_K  256 4- or 5-bit q in 8 sub-blocks of 32, 6-bit scales and mins under f16 d and dmin
                                                w = (d sc) q - (dmin m)   codes q, scale d sc, offset -(dmin m)
Every other type (Q6_K, Q2_K, Q3_K, the IQ types, F16 and F32 layers, ...) is dequantized and quantized to the layout
(`quantize_groups`: 256 levels across each group of 32, within half a level of the file's value): Q6_K's scales
are per 16 weights, which one scale per 32 cannot hold.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config.quantization_config import GGUF_GROUP_SIZE
from jaxserve.quantization.weights import QuantizedTensor, quantize_groups


def grouped_codes(tensor, dequantize) -> QuantizedTensor:
    """A 2-D GGUF tensor ([out, in] in Hugging Face orientation) as int8 codes [out, in] with float32 scales and
    offsets [out, in / 32]; ``dequantize(tensor)`` gives the float32 values of types not kept exactly."""
    out_features, in_features = (int(d) for d in reversed(tensor.shape))
    decode = _DECODERS.get(tensor.tensor_type.name)
    if decode is None:
        codes, scale, offset = quantize_groups(dequantize(tensor).T, GGUF_GROUP_SIZE)
        return QuantizedTensor(codes.T, scale.T, offset.T)
    from gguf.constants import GGML_QUANT_SIZES

    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    codes, scale, offset = decode(np.asarray(tensor.data).view(np.uint8).reshape(-1, type_size))
    groups = (out_features, in_features // GGUF_GROUP_SIZE)
    return QuantizedTensor(codes.reshape(out_features, in_features), scale.reshape(groups), offset.reshape(groups))


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte ``start`` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _no_offset(blocks: np.ndarray) -> np.ndarray:
    """The offsets of a symmetric type's blocks: zero, float32 [n, 1]."""
    return np.zeros((blocks.shape[0], 1), np.float32)


def _nibbles(packed: np.ndarray, run: int = 16) -> np.ndarray:
    """uint8 [n, run k] -> [n, 2 run k]: each ``run``-byte run gives its low nibbles, then its high ones."""
    runs = packed.reshape(packed.shape[0], -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & np.uint8(0x0F)).reshape(packed.shape[0], -1)


def _q8_0(blocks: np.ndarray):
    return blocks[:, 2:].copy().view(np.int8), _half(blocks, 0), _no_offset(blocks)


def _q4_0(blocks: np.ndarray):
    return _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8), _half(blocks, 0), _no_offset(blocks)


def _q4_1(blocks: np.ndarray):
    return _nibbles(blocks[:, 4:]).astype(np.int8), _half(blocks, 0), _half(blocks, 2)


def _fifth_bits(packed: np.ndarray) -> np.ndarray:
    """uint8 [n, 4] (one little-endian uint32 per block) -> the 32 weights' fifth bits, uint8 [n, 32] of 0 or 16."""
    bits = packed.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((bits & np.uint32(1)) << np.uint32(4)).astype(np.uint8)


def _q5_0(blocks: np.ndarray):
    codes = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return codes, _half(blocks, 0), _no_offset(blocks)


def _q5_1(blocks: np.ndarray):
    codes = (_nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])).astype(np.int8)
    return codes, _half(blocks, 0), _half(blocks, 2)


def _k_quant_groups(blocks: np.ndarray, low_bits: np.ndarray, high_bits: np.ndarray | None):
    """A Q4_K / Q5_K super-block (256 weights) as 8 groups of 32: codes [8 n, 32], scales and offsets [8 n].
    ``low_bits``: its 128 bytes of nibbles (32 bytes give a low-nibble and a high-nibble group); ``high_bits``: Q5_K's
    32 bytes whose bit j is the fifth bit of group j."""
    from gguf.quants import Q4_K

    sub_scales, sub_mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = _half(blocks, 0) * sub_scales.astype(np.float32)
    offset = -(_half(blocks, 2) * sub_mins.astype(np.float32))
    codes = _nibbles(low_bits, run=32).reshape(-1, 8, 32)
    if high_bits is not None:
        high = high_bits.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes = codes | ((high & np.uint8(1)) << np.uint8(4))
    return codes.reshape(-1, 32).astype(np.int8), scale.reshape(-1), offset.reshape(-1)


def _q4_k(blocks: np.ndarray):
    return _k_quant_groups(blocks, blocks[:, 16:], None)


def _q5_k(blocks: np.ndarray):
    return _k_quant_groups(blocks, blocks[:, 48:], blocks[:, 16:48])


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
             "Q5_K": _q5_k}
