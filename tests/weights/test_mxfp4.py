"""gpt-oss's mxfp4 expert checkpoints: the dequantization equals transformers' on random blocks and scales, and a
tiny gpt-oss whose experts are stored as mxfp4 loads exactly as a float checkpoint of the dequantized experts (whose
engine equals transformers: tests/models/test_family_engines.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.weights import load_model
from jaxserve.weights.mxfp4 import FP4_VALUES, dequantize_mxfp4, packed_names

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def test_dequantization_equals_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 10, 2), dtype=np.uint8)
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 64, 10)
    np.testing.assert_array_equal(got, expected.numpy())
    with pytest.raises(ValueError, match=r"^mxfp4 blocks \(3, 10, 2, 16\) and scales \(3, 10\) do not match"):
        dequantize_mxfp4(blocks, scales[..., 0])


def quantize_mxfp4(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of float ``weights`` [E, in, out] with in a multiple of 32: per output row and 32 inputs, the
    smallest power-of-two scale that brings them within +-6, each value rounded to the nearest e2m1 value."""
    rows = weights.transpose(0, 2, 1)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponents = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponents)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    blocks, scales = codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)  # safetensors writes a view's buffer as is


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the mxfp4 checkpoint, a float checkpoint of its dequantized experts) of one tiny gpt-oss."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.testing.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("gpt-oss")
    float_dir = make_tiny_model(root / "float", "gpt_oss", seed=6, hidden_size=64, intermediate_size=64)
    packed_dir = root / "mxfp4"
    packed_dir.mkdir()
    for file in float_dir.iterdir():
        if file.suffix != ".safetensors":
            (packed_dir / file.name).write_bytes(file.read_bytes())
    tensors, packed = {}, {}
    for file in float_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    for name in list(tensors):
        if name.endswith(EXPERT_TENSORS):
            blocks, scales = quantize_mxfp4(tensors[name].astype(np.float32))
            packed.update(zip(packed_names(name), (blocks, scales), strict=True))
            tensors[name] = dequantize_mxfp4(blocks, scales).astype(tensors[name].dtype)
        else:
            packed[name] = tensors[name]
    for file in float_dir.glob("*.safetensors"):
        file.unlink()
    (float_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    (packed_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, float_dir / "model.safetensors")
    save_file(packed, packed_dir / "model.safetensors")
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, float_dir


def test_an_mxfp4_checkpoint_loads_its_dequantized_experts(checkpoints):
    packed_dir, float_dir = checkpoints
    packed, plain = load_model(str(packed_dir)), load_model(str(float_dir))
    assert packed.config.quantization is None and packed.config == plain.config
    experts = lambda params: params["params"]["layers"]["mlp"]["experts"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(np.asarray(experts(packed.params)[name]), np.asarray(experts(plain.params)[name]))

