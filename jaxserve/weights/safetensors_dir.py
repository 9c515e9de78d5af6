"""Loads a Hugging Face model directory: config.json, sharded `*.safetensors` (with or without an index); gpt-oss's
mxfp4 experts and DeepSeek's block-wise float8 weights are dequantized as they are read (`mxfp4.py`,
`fp8_blocks.py`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxserve.config.model_config import ModelConfig
from jaxserve.weights.compressed_tensors import CheckpointTensors, checkpoint_scheme, has_kv_cache_scales
from jaxserve.weights.convert import hf_name_alternatives, hf_param_names, params_from_hf
from jaxserve.weights.fp8_blocks import block_size, dequantize_fp8_blocks, scale_name
from jaxserve.weights.mxfp4 import dequantize_mxfp4, packed_names

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> ModelConfig:
    """The model's config; a checkpoint stored quantized (compressed-tensors) carries its scheme, and whether it
    gives float8 K/V scales."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    hf = json.loads(path.read_text())
    scheme = checkpoint_scheme(hf)
    config = dataclasses.replace(ModelConfig.from_hf(hf), kv_cache_scales=has_kv_cache_scales(hf))
    return config if scheme is None else dataclasses.replace(config, quantization=scheme)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file holding it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    from safetensors import safe_open

    mapping = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            mapping.update({name: file for name in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    return mapping


def load_safetensors_dir(model_dir: Path, config: ModelConfig, dtype: str) -> dict:
    from safetensors import safe_open

    files = _tensor_files(model_dir)
    stored = {}  # our Hugging Face name -> the name in the files (hub checkpoints may omit a prefix)
    for name in hf_param_names(config):
        stored[name] = next((n for n in hf_name_alternatives(name, config)
                             if n in files or all(p in files for p in packed_names(n))), None)
    missing = [name for name, found in stored.items() if found is None]
    if missing:
        raise ValueError(f"model directory {model_dir} lacks tensors: {', '.join(missing[:5])}")
    handles = {}
    fp8_block = block_size(json.loads((model_dir / "config.json").read_text()))

    def read(name: str) -> np.ndarray:  # by the name in the files; mxfp4 and block-wise float8 weights dequantized
        if name not in files:
            return dequantize_mxfp4(*(read(packed) for packed in packed_names(name)))
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="numpy")
        values = _to_numpy(handles[file], name, file)
        if fp8_block is not None and scale_name(name) in files:
            return dequantize_fp8_blocks(values, read(scale_name(name)), fp8_block)
        return values

    tensors = None
    if config.quantization is not None:  # stored quantized: the scales are read beside the kernels
        tensors = CheckpointTensors(lambda name: read(stored.get(name, name)),
                                    lambda name: stored.get(name, name) in files)
    return params_from_hf(lambda name: read(stored[name]), config, dtype, tensors)


def _to_numpy(handle, name: str, file: Path) -> np.ndarray:
    """Reads one tensor; bfloat16 and float8 e4m3 tensors come back as ml_dtypes arrays."""
    try:
        return handle.get_tensor(name)
    except (TypeError, AttributeError):  # safetensors hands neither bf16 (older versions) nor float8 to numpy
        return _raw_tensor(file, name)


RAW_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}  # safetensors' names -> ml_dtypes'


def _raw_tensor(file: Path, name: str) -> np.ndarray:
    """A tensor read from the file's bytes: an 8-byte little-endian header length, the JSON header (dtype, shape,
    data offsets per tensor), then the data."""
    import ml_dtypes

    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        data = f.read(end - begin)
    dtype = np.dtype(getattr(ml_dtypes, RAW_DTYPES[entry["dtype"]]))
    return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])
