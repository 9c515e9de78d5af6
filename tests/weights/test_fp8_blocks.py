"""DeepSeek's block-wise float8 checkpoints (`weights/fp8_blocks.py`): a tiny DeepSeek-V3 saved with its projections
and experts as float8 e4m3 in blocks of 8 x 8 with their scales loads to the logits of transformers on the same
weights dequantized, and a block's scale multiplies exactly its block."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve.testing.hf_reference import hf_logits
from jaxserve.testing.tiny_models import FAMILY_TOKENS, TINY_FAMILIES, make_tiny_model
from jaxserve.weights import load_model
from jaxserve.weights.fp8_blocks import dequantize_fp8_blocks
from tests.forward import PagedForward

BLOCK = (8, 8)


def test_each_block_takes_its_own_scale_a_partial_last_block_too():
    values = np.ones((10, 9), ml_dtypes.float8_e4m3fn)
    out = dequantize_fp8_blocks(values, np.asarray([[1.0, 2.0], [3.0, 4.0]], np.float32), BLOCK)
    assert out[0, 0] == 1.0 and out[7, 8] == 2.0 and out[8, 7] == 3.0 and out[9, 8] == 4.0
    with pytest.raises(ValueError, match=r"needs scales \(2, 2\), got \(1, 2\)"):
        dequantize_fp8_blocks(values, np.ones((1, 2), np.float32), BLOCK)


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, scale_inv) of a [out, in] weight in blocks of BLOCK, each block's max at 448."""
    rows, cols = BLOCK
    out_features, in_features = weight.shape
    padded = torch.zeros(-(-out_features // rows) * rows, -(-in_features // cols) * cols)
    padded[:out_features, :in_features] = weight
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out_features, :in_features]
    return values.to(torch.float8_e4m3fn), scale


def test_a_block_wise_float8_checkpoint_loads_to_its_dequantized_weights_logits(tmp_path):
    family, overrides = TINY_FAMILIES["deepseek-v3"]
    source = make_tiny_model(tmp_path / "float", family, **overrides)
    tensors = load_file(source / "model.safetensors")
    stored, dequantized = {}, dict(tensors)
    for name, weight in tensors.items():
        if weight.dim() == 2 and name.endswith("proj.weight"):  # projections and experts, as DeepSeek's files
            values, scale = quantize_blocks(weight)
            stored[name], stored[name + "_scale_inv"] = values, scale
            dequantized[name] = torch.from_numpy(dequantize_fp8_blocks(
                values.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), scale.numpy(), BLOCK))
        else:
            stored[name] = weight
    config = json.loads((source / "config.json").read_text())
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    for file in source.glob("tokenizer*"):
        (fp8 / file.name).write_bytes(file.read_bytes())
    save_file(stored, fp8 / "model.safetensors")
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}))
    save_file(dequantized, source / "model.safetensors")  # transformers' reference: the same weights, float
    loaded = load_model(str(fp8), "float32")
    got = PagedForward(loaded.config, loaded.params, backend="cpu", scan_layers=False).run(FAMILY_TOKENS, [3, 0, 5, 1],
                                                                                            [7, 9])
    np.testing.assert_allclose(got, hf_logits(source, FAMILY_TOKENS), atol=2e-5, rtol=0)
    assert sum(name.endswith("_scale_inv") for name in stored) > 10
