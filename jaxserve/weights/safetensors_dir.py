"""Loads a Hugging Face model directory: config.json, sharded `*.safetensors` (with or without an index)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.weights.convert import hf_name_alternatives, hf_param_names, params_from_hf

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    return ModelConfig.from_hf(json.loads(path.read_text()))


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
        stored[name] = next((n for n in hf_name_alternatives(name, config) if n in files), None)
    missing = [name for name, found in stored.items() if found is None]
    if missing:
        raise ValueError(f"model directory {model_dir} lacks tensors: {', '.join(missing[:5])}")
    handles = {}

    def get(name: str) -> np.ndarray:
        file = files[stored[name]]
        if file not in handles:
            handles[file] = safe_open(file, framework="numpy")
        return _to_numpy(handles[file], stored[name])

    return params_from_hf(get, config, dtype)


def _to_numpy(handle, name: str) -> np.ndarray:
    """Reads one tensor; bfloat16 tensors come back as ml_dtypes.bfloat16 arrays."""
    try:
        return handle.get_tensor(name)
    except TypeError:  # older safetensors cannot hand bf16 to numpy: go through raw bytes
        import ml_dtypes

        view = handle.get_slice(name)
        raw = np.frombuffer(view[:].tobytes(), dtype=ml_dtypes.bfloat16)
        return raw.reshape(view.get_shape())
