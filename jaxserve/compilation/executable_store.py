"""Serialized bucket executables, kept next to JAX's persistent cache: a warm start neither traces nor lowers.

Place in the data flow: the engine's warm-up (`engine/engine_builder.py`) and the precompile command hand the
`ModelRunner` an `ExecutableStore` for their compile cache directory, and the runner builds every program through its
`load_or_compile`: the stored executable if there is one, else lowered, compiled and stored. JAX's persistent cache
alone cannot skip lowering: its key is a hash of the lowered program, so every warm start still traced the Flax model
and emitted MLIR for every bucket (about 0.5 s each on 2 CPU cores, most of a warm start).

An executable is stored with `jax.experimental.serialize_executable` under a directory named by a key of
everything that decides the compiled program without being an input shape: the cache manifest (model
configuration, dtype, bucket file, the source of every file traced into the steps, engine limits, jax
and jaxlib versions, platform and device kind) plus the flax version, the XLA/libtpu flags and the JAX
options that change lowering. A loaded executable is also checked against the call it will serve (the
argument tree, every shape and dtype); a mismatch, a missing or an unreadable file means "not stored",
and the runner compiles as before. Only executables XLA compiled in this process are stored: one that
JAX loaded from its own persistent cache serializes without part of its code on XLA:CPU (the next
process fails with "Function ... not found"), so it stays in JAX's cache only. Files are written
atomically, so concurrent writers never leave a half-written executable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from jaxserve.compilation.compile_cache import CacheManifest, thread_compile_counts
from jaxserve.logger import init_logger

logger = init_logger("jaxserve.compilation.executable_store")

STORE_DIR_NAME = "jaxserve_executables"
STORE_FORMAT = 2  # 2: nothing loaded from JAX's persistent cache is stored (format 1 stores may hold broken code)
# JAX options that change the lowered program of the same Python code.
_LOWERING_OPTIONS = (
    "jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
)
_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_RUNTIME_ONLY_FLAGS = ("--xla_tpu_use_enhanced_launch_barrier=true",)  # jax's cloud_tpu_init sets it


def store_key(manifest: CacheManifest, num_devices: int | None = None, first_device: int = 0) -> str:
    """Hash of everything, besides the input shapes, that decides a compiled step on ``num_devices``
    devices (default: this process's device count; a target's when compiling for another host) from device
    ``first_device`` on (a data-parallel replica's group: a serialized executable keeps its devices)."""
    import flax

    compared = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(manifest) if f.compare}
    environment = {
        "store_format": STORE_FORMAT,
        "flax_version": flax.__version__,
        "flags": {name: _compile_flags(os.environ.get(name, "")) for name in _FLAG_VARIABLES},
        "jax_options": {name: str(getattr(jax.config, name, None)) for name in _LOWERING_OPTIONS},
        "num_devices": jax.device_count() if num_devices is None else num_devices,
    }
    if first_device:  # only then: the stores of every engine on the first devices keep their keys
        environment["first_device"] = first_device
    body = json.dumps({"manifest": compared, "environment": environment}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def _compile_flags(value: str) -> str:
    """A flags variable without the runtime-only flags that JAX itself adds on a TPU VM (the same cache must
    match on the VM and on the host that precompiled for it)."""
    return " ".join(flag for flag in value.split() if flag not in _RUNTIME_ONLY_FLAGS)


def _signature(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], str]]]:
    """The argument tree and the (shape, dtype) of every leaf: what an executable must be called with."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves]


# The custom call of jax.pure_callback / io_callback on CPU (the Pallas interpreter uses them).
PYTHON_CALLBACK = "python_cpu_callback"


class ExecutableStore:
    """One configuration's serialized executables, one file per name, under ``cache_dir``."""

    def __init__(self, cache_dir: str | Path, manifest: CacheManifest, num_devices: int | None = None,
                 first_device: int = 0):
        self.directory = Path(cache_dir) / STORE_DIR_NAME / store_key(manifest, num_devices, first_device)
        self.loaded: set[str] = set()  # names this store gave out (their callers compiled nothing)
        self.num_saved = 0

    @property
    def num_loaded(self) -> int:
        return len(self.loaded)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.executable"

    def load(self, name: str, abstract_args: tuple) -> jax.stages.Compiled | None:
        """The stored executable for ``name`` if there is one that takes ``abstract_args``, else None."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as err:  # noqa: BLE001 - a damaged or foreign file: compile instead
            logger.warning("ignoring unreadable stored executable %s (%s: %s)", path, type(err).__name__, err)
            return None
        stored_args, _ = compiled.args_info
        if _signature(stored_args) != _signature(abstract_args):
            logger.warning("ignoring stored executable %s: it takes other argument shapes", path)
            return None
        self.loaded.add(name)
        return compiled

    def save(self, name: str, compiled: jax.stages.Compiled) -> None:
        """Stores ``compiled`` under ``name`` (atomically; an executable that cannot be serialized is skipped).
        One that calls back into Python (the Pallas kernels interpreted on CPU) is skipped before serializing:
        pickle refuses its callback (an AttributeError) and, sharded over several devices, JAX's serializer
        crashed the process (a segmentation fault in `serialize_executable`, jax 0.10.2)."""
        if PYTHON_CALLBACK in compiled.as_text():
            logger.warning("cannot store executable %s (it calls back into Python)", name)
            return
        try:
            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((payload, in_tree, out_tree))
        except (ValueError, NotImplementedError, pickle.PicklingError, TypeError, AttributeError) as err:
            logger.warning("cannot store executable %s (%s)", name, err)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        self.num_saved += 1

    def load_or_compile(self, name: str, jitted, abstract_args: tuple,
                        compiler_options: dict | None = None) -> jax.stages.Compiled:
        """The executable of ``jitted`` on ``abstract_args``: the stored one (no tracing, no lowering), else
        lowered and compiled, and then stored if XLA compiled it (an executable JAX loaded from its persistent
        cache serializes without part of its code on XLA:CPU, and fails with "Function ... not found" once
        loaded again, so it is left to JAX's cache)."""
        compiled = self.load(name, abstract_args)
        if compiled is None:
            before = thread_compile_counts()
            compiled = jitted.lower(*abstract_args).compile(compiler_options)
            if (thread_compile_counts() - before).fresh_compiles:
                self.save(name, compiled)
        return compiled
