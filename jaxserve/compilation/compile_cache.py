"""JAX's persistent compilation cache for the bucket executables, its manifest, and compile counters.

Place in the data flow: `scripts/precompile.py` (or `jaxserve precompile`) compiles every bucket into a
cache directory and writes a manifest there; `LLMEngine` points JAX at the same directory, checks the
manifest against its own configuration and then warms up, loading executables from the cache instead of
compiling them. The cache is on by default (as in vLLM's TPU backend), so a second start is warm.

- `resolve_cache_dir(compile_cache_dir)` is the one place that turns the engine's `compile_cache_dir`
  into a directory: None (the default) means ``$JAXSERVE_COMPILE_CACHE_DIR`` if that variable is set
  (set but empty: no persistent cache), else the per-user `default_cache_dir()`
  (``~/.cache/jaxserve/compile_cache``); a path is used as given; ``""`` disables the persistent cache.
- `enable_persistent_cache(dir)` sets JAX's cache directory and lowers JAX's thresholds to zero, so
  every executable is written, however small or fast to compile (JAX's default skips executables
  compiled in under a second). JAX 0.10.2 writes and reads CPU executables too. One more setting
  matters: JAX's XLA side caches (`jax_persistent_cache_enable_xla_caches`, GPU autotuning by default)
  put a path under the cache directory into the compile options, which are hashed into every key, so a
  copied or re-mounted cache would miss everything (measured: a copy of a cache directory had 0 hits);
  they are turned off, which makes a cache directory relocatable. JAX's configuration is
  process-wide: the last directory set wins.
- `CacheManifest` records what a directory was compiled for: hashes of the model configuration, the
  bucket file and the step code, the dtype, the engine limits that decide the bucket grid and the
  KV-pool shape, jax/jaxlib versions, platform and device kind. JAX keys its entries by the compiled
  program, so a foreign entry is never loaded by mistake; the manifest is what makes a stale or foreign
  cache *visible* (`check_manifest`) instead of silently half-used.
- `compile_counts()` / `thread_compile_counts()` count XLA compilations and persistent-cache hits from
  `jax.monitoring` events. JAX reports `/jax/core/compile/backend_compile_duration` for every executable
  it builds, whether loaded from the cache or compiled; a load also reports
  `/jax/compilation_cache/cache_hits`. Fresh compilations are the difference. Listeners run in the
  thread that compiles, so the per-thread counts attribute compilations to a bucket or an engine step
  even while other threads compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from jaxserve.config.model_config import ModelConfig
from jaxserve.core.buckets import BucketGrid, BucketSpec
from jaxserve.user_cache import cache_root

CACHE_DIR_ENV = "JAXSERVE_COMPILE_CACHE_DIR"  # overrides the default directory; empty: no persistent cache
MANIFEST_NAME = "jaxserve_manifest.json"
MANIFEST_VERSION = 1
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_WRITE_EVENT = "/jax/compilation_cache/cache_misses"  # JAX records it when it writes an entry

# The code traced into the step executables: a change there changes the compiled programs, so the manifest
# hashes it (folders whole: every .py and .cc file). tests/compilation/test_step_code.py lowers every program
# of each model family on each attention backend and checks that every file the lowering runs is listed.
STEP_CODE = (
    "jaxserve/runner", "jaxserve/models", "jaxserve/attention", "jaxserve/quantization",
    "jaxserve/distributed/sharding.py",
    "jaxserve/math_utils.py", "jaxserve/reductions.py", "jaxserve/config", "kernels_pallas", "kernels_cpu",
)
_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds jaxserve/ and the kernel packages


# -- the cache directory ----------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/jaxserve/compile_cache`` (``~/.cache/jaxserve/compile_cache``)."""
    return cache_root() / "compile_cache"


def resolve_cache_dir(compile_cache_dir: str | os.PathLike | None, *, required: bool = False) -> Path | None:
    """The persistent cache directory ``compile_cache_dir`` stands for, or None when the cache is disabled.

    None: ``$JAXSERVE_COMPILE_CACHE_DIR`` if the variable is set (an empty value disables the cache), else
    `default_cache_dir()`. A path: that directory (``~`` expanded). ``""``: disabled. With ``required``
    a disabled cache raises ValueError (`jaxserve precompile` has nowhere else to put its executables).
    """
    value = os.environ.get(CACHE_DIR_ENV) if compile_cache_dir is None else os.fspath(compile_cache_dir)
    if value is None:
        return default_cache_dir()
    if value:
        return Path(value).expanduser()
    if required:
        source = f"{CACHE_DIR_ENV}=''" if compile_cache_dir is None else "compile_cache_dir=''"
        raise ValueError(
            f"the persistent compile cache is disabled ({source}), and precompiling needs a directory: "
            "pass --compile-cache-dir DIR (compile_cache_dir=DIR)"
        )
    return None


def enable_persistent_cache(cache_dir: str | Path) -> Path:
    """Points JAX's persistent compilation cache at ``cache_dir`` (created if missing) for every executable."""
    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, no override
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")  # relocatable (see above)
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        # JAX opens its cache object once; forget one opened on another directory.
        jax_compilation_cache.reset_cache()
    return path


def use_persistent_cache(cache_dir: str | Path | None) -> Path | None:
    """Points JAX's persistent cache at ``cache_dir`` (`enable_persistent_cache`), or turns it off for None;
    returns the directory in use."""
    if cache_dir is None:
        disable_persistent_cache()
        return None
    return enable_persistent_cache(cache_dir)


def disable_persistent_cache() -> None:
    """Stops reading and writing the persistent cache in this process (JAX's default state)."""
    if jax.config.jax_compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", None)
        jax_compilation_cache.reset_cache()


def persistent_cache_dir() -> Path | None:
    """The directory JAX's persistent cache currently uses, if any."""
    value = jax.config.jax_compilation_cache_dir
    return Path(value) if value else None


def num_cache_entries(cache_dir: str | Path) -> int:
    """Executables stored in a JAX cache directory (JAX names its entry files ``<key>-cache``)."""
    return sum(1 for p in Path(cache_dir).iterdir() if p.name.endswith("-cache"))


# -- compile counters -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """Executables built (``backend_compiles``), of which loaded from the persistent cache (``cache_hits``)."""

    backend_compiles: int = 0
    cache_hits: int = 0
    cache_writes: int = 0

    @property
    def fresh_compiles(self) -> int:
        """Executables XLA actually compiled (not loaded from the cache)."""
        return self.backend_compiles - self.cache_hits

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.backend_compiles - other.backend_compiles,
            self.cache_hits - other.cache_hits,
            self.cache_writes - other.cache_writes,
        )


_FIELD_OF_EVENT = {BACKEND_COMPILE_EVENT: "backend_compiles", CACHE_HIT_EVENT: "cache_hits",
                   CACHE_WRITE_EVENT: "cache_writes"}
_process_counts: dict[str, int] = dict.fromkeys(_FIELD_OF_EVENT.values(), 0)
_thread_state = threading.local()
_lock = threading.Lock()


def _count(event: str) -> None:
    field = _FIELD_OF_EVENT.get(event)
    if field is None:
        return
    with _lock:
        _process_counts[field] += 1
    counts = getattr(_thread_state, "counts", None)
    if counts is None:
        counts = _thread_state.counts = dict.fromkeys(_FIELD_OF_EVENT.values(), 0)
    counts[field] += 1


jax.monitoring.register_event_listener(lambda event, **_: _count(event))
jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **_: _count(event))


def compile_counts() -> CompileCounts:
    """Counts over the whole process since import."""
    with _lock:
        return CompileCounts(**_process_counts)


def num_backend_compiles() -> int:
    """Every XLA compilation in this process so far (ours or anyone's): "no compile after warm-up" checks."""
    return compile_counts().backend_compiles


def thread_compile_counts() -> CompileCounts:
    """Counts of compilations run by the calling thread since import."""
    counts = getattr(_thread_state, "counts", None)
    return CompileCounts(**counts) if counts else CompileCounts()


# -- the manifest -----------------------------------------------------------------------------------


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def model_config_hash(config: ModelConfig) -> str:
    return _sha256(dataclasses.asdict(config))


def bucket_spec_hash(spec: BucketSpec) -> str:
    """Hash of the bucket file's values (comments and formatting do not change any executable)."""
    fields = ("decode_batch_sizes", "prefill_batch_sizes", "prefill_lengths", "context_lengths", "block_size",
              "mixed_batch_sizes", "mixed_token_counts")
    return _sha256({name: getattr(spec, name) for name in fields})


def step_code_files() -> list[Path]:
    """The source files of `STEP_CODE`, in a fixed order."""
    files = []
    for entry in STEP_CODE:
        path = _ROOT / entry
        files += sorted([*path.rglob("*.py"), *path.rglob("*.cc")]) if path.is_dir() else [path]
    return [file for file in files if file.is_file()]


def step_code_hash() -> str:
    """Hash of the source files traced into the step executables (each with its path)."""
    digest = hashlib.sha256()
    for file in step_code_files():
        digest.update(file.relative_to(_ROOT).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheManifest:
    """One configuration a cache directory was compiled for; every field but ``info`` must match."""

    model_config_hash: str
    dtype: str
    bucket_file_hash: str
    step_code_hash: str
    engine_limits: dict[str, Any]  # block_size, num_kv_blocks, max_model_len, ...: grid and pool shape
    jax_version: str
    jaxlib_version: str
    platform: str
    device_kind: str
    # informational, not compared: model path, bucket file, bucket count, when written
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def current(
        cls, model_config: ModelConfig, dtype: str, grid: BucketGrid, attention_backend: str,
        tensor_parallel_size: int = 1, max_logprobs: int = 20, device=None, kv_cache_dtype: str = "auto",
        **info: Any,
    ) -> CacheManifest:
        """The manifest of this process's configuration (platform and versions of the running JAX) on
        ``device``'s kind (default: this host's first device; a target's when compiling for another)."""
        import jaxlib

        device = device or jax.devices()[0]
        limits = {
            "block_size": grid.block_size,
            "num_kv_blocks": grid.num_blocks,
            "max_model_len": grid.max_model_len,
            "max_num_seqs": grid.max_num_seqs,
            "max_num_batched_tokens": grid.max_num_batched_tokens,
            "mixed_token_limit": grid.mixed_token_limit,  # the largest mixed steps: a latency target's or not
            "attention_backend": attention_backend,
            "tensor_parallel_size": tensor_parallel_size,
            "max_logprobs": max_logprobs,  # the steps' top-K logprobs shape
            "kv_cache_dtype": kv_cache_dtype,  # the pool's dtype
        }
        info = {"bucket_file": grid.spec.source, "num_executables": grid.num_executables, **info}
        return cls(
            model_config_hash=model_config_hash(model_config), dtype=dtype,
            bucket_file_hash=bucket_spec_hash(grid.spec), step_code_hash=step_code_hash(),
            engine_limits=limits, jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
            platform=device.platform, device_kind=device.device_kind, info=info,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheManifest:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data and n != "info"]
        if missing:
            raise ValueError(f"manifest entry lacks {', '.join(missing)}")
        return cls(**{n: data[n] for n in names if n in data})

    def differences(self, recorded: CacheManifest) -> list[str]:
        """Human-readable differences between this (current) configuration and a recorded manifest."""
        diffs = []
        for f in dataclasses.fields(self):
            if f.name == "info":
                continue
            now, then = getattr(self, f.name), getattr(recorded, f.name)
            if f.name == "engine_limits":
                diffs += [
                    f"{key}: cache has {then.get(key)!r}, now {now.get(key)!r}"
                    for key in sorted(set(now) | set(then)) if now.get(key) != then.get(key)
                ]
            elif now != then:
                shown = (lambda v: v[:12]) if f.name.endswith("_hash") else (lambda v: v)
                diffs.append(f"{f.name}: cache has {shown(then)!r}, now {shown(now)!r}")
        return diffs


FOREIGN_FIELDS = ("jax_version", "jaxlib_version", "platform", "device_kind")


@dataclasses.dataclass(frozen=True)
class CacheCheck:
    """Result of comparing a cache directory's manifest with the running configuration.

    ``state``: "empty" (no manifest: nothing precompiled here), "match" (some entry is this
    configuration), "stale" (compiled for another model, dtype, bucket file, code or engine limits;
    ``differences`` against the newest entry) or "foreign" (every entry is for another JAX version,
    platform or device kind).
    """

    cache_dir: Path
    state: str
    differences: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.state == "match"

    def describe(self) -> str:
        if self.state == "empty":
            return f"compile cache {self.cache_dir}: no manifest (not precompiled); compiling into it"
        if self.state == "match":
            return f"compile cache {self.cache_dir}: manifest matches"
        return (
            f"compile cache {self.cache_dir} is {self.state}: its executables were compiled for another "
            f"configuration and will not all be reused ({'; '.join(self.differences)}). Re-run "
            "`jaxserve precompile` with this configuration."
        )


def manifest_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / MANIFEST_NAME


def read_manifests(cache_dir: str | Path) -> list[CacheManifest]:
    """The configurations a cache directory holds executables for, oldest first (one directory may
    serve several models: JAX keys every entry by its program)."""
    path = manifest_path(cache_dir)
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("manifest_version") != MANIFEST_VERSION:
            raise ValueError(f"manifest_version {data.get('manifest_version')!r}, expected {MANIFEST_VERSION}")
        return [CacheManifest.from_dict(entry) for entry in data["entries"]]
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"unreadable compile cache manifest {path}: {err}") from None


def record_manifest(cache_dir: str | Path, manifest: CacheManifest) -> Path:
    """Adds ``manifest`` to the directory's manifest file (replacing an equal entry: the newest is last)."""
    entries = [m for m in read_manifests(cache_dir) if m != manifest] + [manifest]
    path = manifest_path(cache_dir)
    tmp = path.with_name(path.name + ".tmp")
    body = {"manifest_version": MANIFEST_VERSION, "entries": [dataclasses.asdict(m) for m in entries]}
    tmp.write_text(json.dumps(body, indent=2))
    tmp.replace(path)  # atomic: a concurrent reader sees the old or the new manifest
    return path


def check_manifest(cache_dir: str | Path, current: CacheManifest) -> CacheCheck:
    """Whether ``cache_dir`` was compiled for ``current``; if not, how its newest entry differs."""
    recorded = read_manifests(cache_dir)
    if not recorded:
        return CacheCheck(Path(cache_dir), "empty")
    if current in recorded:
        return CacheCheck(Path(cache_dir), "match")
    newest = recorded[-1]
    foreign = all(any(getattr(current, f) != getattr(m, f) for f in FOREIGN_FIELDS) for m in recorded)
    return CacheCheck(Path(cache_dir), "foreign" if foreign else "stale", tuple(current.differences(newest)))
