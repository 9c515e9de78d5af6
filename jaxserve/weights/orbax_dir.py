"""Orbax checkpoint directories: this package's own serving format.

`scripts/convert_checkpoint.py` writes one from a Hugging Face directory or a GGUF file with
`save_orbax_dir`; `load_model` recognises it by its marker file and calls `load_orbax_dir`, which restores
every array straight into its target sharding on the mesh (each device reads only its shard; no host
copy of the whole tree, no conversion at start-up). Layout:

    <dir>/jaxserve_checkpoint.json   marker: format version, the ModelConfig, the stored dtype, the source
    <dir>/params/                    the parameter tree as an orbax (OCDBT) checkpoint, uncompressed by default
    <dir>/tokenizer files, config.json (when the source had one)

A quantized checkpoint (`convert_checkpoint.py --quantization`) records its scheme in the ModelConfig and keeps its
quantized kernels (int8, float8) and their float32 scales as stored; only the float leaves take the serving dtype.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.config.model_config import ModelConfig
from jaxserve.config.quantization_config import QuantScheme
from jaxserve.config.rope_config import RopeConfig

MARKER_FILE = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and (path / MARKER_FILE).is_file()


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    fields = dict(data)
    fields["rope"] = RopeConfig(**fields["rope"])
    if fields.get("local_rope") is not None:
        fields["local_rope"] = RopeConfig(**fields["local_rope"])
    if fields.get("quantization") is not None:
        fields["quantization"] = QuantScheme(**fields["quantization"])
    for name in ("eos_token_id", "layer_types", "mlp_only_layers"):  # JSON lists back to the config's tuples
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    return ModelConfig(**fields)


def read_orbax_config(path: Path) -> ModelConfig:
    marker = json.loads((path / MARKER_FILE).read_text())
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path / MARKER_FILE}: checkpoint format version {marker.get('format_version')!r} is not "
            f"supported (expected {FORMAT_VERSION}); convert the model again with scripts/convert_checkpoint.py"
        )
    return config_from_dict(marker["model_config"])


def save_orbax_dir(
    out: Path, config: ModelConfig, params: dict, tokenizer, *, source: Path, dtype: str, compress: bool = False
) -> None:
    """Writes params (numpy or jax arrays), the config and the tokenizer files into a new directory `out`.

    Arrays are stored uncompressed unless `compress` (zstd): decompression made restoring the embedded
    SmolLM2 about 2x slower on CPU (docs/benchmarks/startup.md), and serving start-up is what this format is for."""
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=False)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress))
    checkpointer.save(out / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    tokenizer.save_pretrained(out)
    if source.is_dir() and (source / "config.json").is_file():
        shutil.copy(source / "config.json", out / "config.json")
    marker = {
        "format_version": FORMAT_VERSION, "dtype": dtype, "source": str(source), "compressed": compress,
        "model_config": config_to_dict(config),
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def stored_param_shapes(path: Path) -> dict:
    """The parameter tree of a checkpoint as ShapeDtypeStructs (stored shapes and dtypes), read from its
    metadata without touching the arrays."""
    import orbax.checkpoint as ocp

    metadata = ocp.StandardCheckpointer().metadata(path / PARAMS_DIR).item_metadata
    tree = getattr(metadata, "tree", metadata)
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)), tree)


def _kept_as_stored(path, dtype) -> bool:
    """A quantized kernel (int8 or float8 values) or its scales and offsets: restored in the stored dtype."""
    name = str(getattr(path[-1], "key", path[-1]))
    if name.endswith(("_scale", "_offset")):
        return True
    return not jax.numpy.issubdtype(dtype, jax.numpy.floating) or dtype.itemsize == 1


def load_orbax_dir(path: Path, dtype: str, mesh) -> tuple[ModelConfig, dict]:
    """Returns (ModelConfig, params): each array restored directly into its mesh sharding, cast to `dtype` (quantized
    kernels and their scales restored as stored)."""
    import orbax.checkpoint as ocp

    from jaxserve.distributed.sharding import check_tensor_parallel, param_shardings

    config = read_orbax_config(path)
    check_tensor_parallel(config, mesh.size)
    stored = stored_param_shapes(path)
    target_dtype = jax.numpy.dtype(dtype)
    target = jax.tree_util.tree_map_with_path(
        lambda path, x, sharding: jax.ShapeDtypeStruct(
            x.shape, x.dtype if _kept_as_stored(path, x.dtype) else target_dtype, sharding=sharding),
        stored, param_shardings(stored, mesh),
    )
    params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)
    return config, params
