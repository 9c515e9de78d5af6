"""The converted-weights cache: the second load of a GGUF file skips the file's parse and the conversion, and the
second read of its config skips the parse too.

Place in the data flow: `load_model` asks `cached_conversion` for a GGUF file's config dict and host parameter tree
(before the runner places them on the mesh, so tensor-parallel placement is the uncached path's). A miss runs the
loader (`gguf_file.load_gguf`) and stores its result; a hit maps the stored arrays (`np.load(mmap_mode="r")`).

An entry is ``<cache>/<stem>-<key>/``: ``entry.json`` (the Hugging Face config dict, and per leaf of
the tree its path, file, dtype and shape) and one ``.npy`` per leaf; bfloat16 and float8 leaves are stored as an
unsigned integer view of their bytes and viewed back. The key is the file's resolved path, size and mtime_ns, the
serving dtype, the quantization and a hash of the conversion code (this package, `quantization/weights.py` and
gguf's dequantizer), so that a change to any of them misses. An entry is written to a staging directory and renamed
into place (a concurrent reader never sees half of one); a read-only cache only costs the conversion next time; an
entry that does not read back whole (a file missing, truncated, of another dtype or shape) is a miss, converted and
written again. Writing an entry removes the entries of the same file, dtype and quantization under other keys, and
those whose file is gone. ``<cache>`` is ``$JAXSERVE_WEIGHTS_CACHE_DIR`` where that variable is set (set but empty:
no cache, neither read nor written), else ``cache_root()/weights``, as ``JAXSERVE_COMPILE_CACHE_DIR`` picks the
compile cache's directory.

A GGUF file's config alone (`load_config`: what precompile and the deviceless targets plan with) is kept beside the
entries as ``<cache>/<stem>-<key>.config.json``, the key without dtype and quantization: gguf's reader parses every
metadata field, the tokenizer's 49152 tokens and merges of the embedded model among them (4 s on a 2-core EPYC),
to give the few the config needs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.user_cache import cache_root, file_cache_name

WEIGHTS_CACHE_ENV = "JAXSERVE_WEIGHTS_CACHE_DIR"
ENTRY_FILE = "entry.json"
_PACKAGE_DIR = Path(__file__).resolve().parent
_QUANTIZATION_SOURCE = _PACKAGE_DIR.parent / "quantization" / "weights.py"
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)

Converter = Callable[[Path, str, "str | None"], tuple[dict, dict]]


def weights_cache_dir() -> Path | None:
    """The cache's directory: ``$JAXSERVE_WEIGHTS_CACHE_DIR`` (empty: None, no cache), else under `cache_root`."""
    value = os.environ.get(WEIGHTS_CACHE_ENV)
    if value is None:
        return cache_root() / "weights"
    return Path(value).expanduser() if value else None


def cached_conversion(path: Path, dtype: str, quantization: str | None, convert: Converter) -> tuple[dict, dict]:
    """(config dict, host params) of the model file ``path`` as ``convert(path, dtype, quantization)`` returns
    them, from the cache where an entry reads back whole, else converted and stored."""
    cache_dir = weights_cache_dir()
    if cache_dir is None:
        return convert(path, dtype, quantization)
    directory = converted_weights_dir(cache_dir, path, dtype, quantization)
    hit = read_entry(directory)
    if hit is not None:
        return hit
    config, params = convert(path, dtype, quantization)
    write_entry(directory, config, params, {"source": str(path.resolve()), "dtype": dtype,
                                            "quantization": quantization})
    return config, params


def cached_config(path: Path, read: Callable[[Path], dict]) -> dict:
    """The config dict ``read(path)`` returns for the model file ``path``, from the cache where it is kept, else read
    and kept (a read-only cache only costs the read next time)."""
    cache_dir = weights_cache_dir()
    if cache_dir is None:
        return read(path)
    kept = cache_dir / f"{file_cache_name(path, conversion_code_hash())}.config.json"
    try:
        return json.loads(kept.read_text())
    except (OSError, ValueError):
        pass
    config = read(path)
    staging = kept.with_name(f"{kept.name}.tmp{os.getpid()}")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps(config))
        os.replace(staging, kept)
    except OSError:
        staging.unlink(missing_ok=True)
    return config


def converted_weights_dir(cache_dir: Path, path: Path, dtype: str, quantization: str | None) -> Path:
    """Where the weights converted from ``path`` for ``dtype`` and ``quantization`` are kept in ``cache_dir``."""
    return cache_dir / file_cache_name(path, dtype, quantization, conversion_code_hash())


@functools.cache
def conversion_code_hash() -> str:
    """A hash of the code that turns a file into the parameter tree: a change to it invalidates the cache."""
    sources = sorted(_PACKAGE_DIR.glob("*.py")) + [_QUANTIZATION_SOURCE]
    gguf_spec = importlib.util.find_spec("gguf")
    if gguf_spec is not None and gguf_spec.submodule_search_locations:
        sources.append(Path(list(gguf_spec.submodule_search_locations)[0]) / "quants.py")
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def read_entry(directory: Path) -> tuple[dict, dict] | None:
    """(config dict, params) of a cache entry, its arrays mapped read-only; None where it does not read back whole."""
    try:
        entry = json.loads((directory / ENTRY_FILE).read_text())
        params: dict = {}
        for leaf in entry["leaves"]:
            _put(params, leaf["path"], _load_leaf(directory / leaf["file"], leaf["dtype"], tuple(leaf["shape"])))
        return entry["config"], params
    except _READ_ERRORS:
        return None


def write_entry(directory: Path, config: dict, params: dict, about: dict) -> None:
    """Stores an entry through a staging directory renamed into place; ``about`` (source, dtype, quantization)
    is kept in it to find the entries it replaces. Trees with a leaf that is not an array are not stored."""
    leaves = _leaves(params)
    if leaves is None:
        return
    staging = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    try:
        staging.mkdir(parents=True)
        records = [_save_leaf(staging, f"{index}.npy", leaf_path, array)
                   for index, (leaf_path, array) in enumerate(leaves)]
        (staging / ENTRY_FILE).write_text(json.dumps({**about, "config": config, "leaves": records}))
        _remove_stale(directory, about)
        shutil.rmtree(directory, ignore_errors=True)  # an entry that did not read back whole
        os.replace(staging, directory)
    except (OSError, TypeError, ValueError):
        shutil.rmtree(staging, ignore_errors=True)  # a read-only or racing cache only costs the conversion


def _remove_stale(directory: Path, about: dict) -> None:
    """Removes the other entries of the same file, dtype and quantization, and those whose file is gone."""
    for sibling in directory.parent.iterdir():
        if sibling == directory or ".tmp" in sibling.name or not (sibling / ENTRY_FILE).is_file():
            continue
        try:
            other = json.loads((sibling / ENTRY_FILE).read_text())
            same = all(other.get(key) == value for key, value in about.items())
            stale = same or not Path(other["source"]).exists()
        except _READ_ERRORS:
            stale = True
        if stale:
            shutil.rmtree(sibling, ignore_errors=True)


def _leaves(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], np.ndarray]] | None:
    """(path, array) of every leaf of a nested dict of numpy arrays; None where a leaf is anything else."""
    leaves = []
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(key, str):
            inner = _leaves(value, (*prefix, key))
            if inner is None:
                return None
            leaves.extend(inner)
        elif isinstance(value, np.ndarray) and isinstance(key, str):
            leaves.append(((*prefix, key), value))
        else:
            return None
    return leaves


def _save_leaf(directory: Path, name: str, leaf_path: tuple[str, ...], array: np.ndarray) -> dict:
    """Saves one leaf; ml_dtypes' types (bfloat16, float8) as the unsigned integers of their bytes."""
    stored = array.view(f"u{array.dtype.itemsize}") if array.dtype.kind == "V" else array
    np.save(directory / name, np.ascontiguousarray(stored), allow_pickle=False)  # tofile is slow on strided arrays
    return {"path": list(leaf_path), "file": name, "dtype": array.dtype.name, "shape": list(array.shape)}


def _load_leaf(file: Path, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    dtype = np.dtype(getattr(ml_dtypes, dtype_name)) if hasattr(ml_dtypes, dtype_name) else np.dtype(dtype_name)
    stored = np.load(file, mmap_mode="r", allow_pickle=False)
    expected = np.dtype(f"u{dtype.itemsize}") if dtype.kind == "V" else dtype
    if stored.dtype != expected or stored.shape != shape:
        raise ValueError(f"{file} holds {stored.dtype}{stored.shape}, not {expected}{shape}")
    return stored.view(dtype=dtype, type=np.ndarray)


def _put(tree: dict, leaf_path: list[str], value: np.ndarray) -> None:
    for key in leaf_path[:-1]:
        tree = tree.setdefault(key, {})
    tree[leaf_path[-1]] = value
