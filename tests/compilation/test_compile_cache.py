"""Precompiled bucket caches: a tiny model's grid is precompiled in one process and a second process
starts the engine from it with zero fresh compiles; the manifest reports a changed bucket file, model,
dtype, engine limit or device; strict mode raises on a compile after warm-up; the counters count."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.compilation.compile_cache import (
    CACHE_DIR_ENV,
    CacheManifest,
    check_manifest,
    compile_counts,
    default_cache_dir,
    disable_persistent_cache,
    enable_persistent_cache,
    manifest_path,
    num_cache_entries,
    persistent_cache_dir,
    read_manifests,
    record_manifest,
    resolve_cache_dir,
    thread_compile_counts,
)
from jaxserve.compilation.executable_store import STORE_DIR_NAME, ExecutableStore, store_key
from jaxserve.compilation.precompile import abstract_params, precompile
from jaxserve.compilation.sizing import DEFAULT_CPU_KV_BLOCKS, engine_bucket_grid
from jaxserve.config.engine_config import EngineConfig
from jaxserve.distributed.sharding import make_mesh
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.entrypoints.args import engine_config_from_args
from jaxserve.entrypoints.cli import build_parser
from jaxserve.sampling_params import SamplingParams
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_config, load_model
from tests.paths import REPO_ROOT, SCRIPTS

SMALL_SPEC = """
block_size = 16
[decode]
batch_sizes = [1, 2]
[prefill]
batch_sizes = [1]
lengths = [16]
[context]
lengths = [64]
[mixed]
batch_sizes = [2]
token_counts = [16]
"""
BUCKET_NAMES = [
    "prefill b=1 chunk=16 ctx=64", "decode  b=1 ctx=64", "decode  b=2 ctx=64", "mixed   b=2 tokens=16 ctx=64",
]
PROMPT = [5, 9, 17, 33, 65, 129]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


@pytest.fixture(scope="module")
def bucket_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("buckets") / "small.toml"
    path.write_text(SMALL_SPEC)
    return path


@pytest.fixture(autouse=True)
def no_persistent_cache_after_test():
    """JAX's cache directory is process-wide: leave this process as the test found it."""
    yield
    disable_persistent_cache()


def _run(args: list[str], timeout: int = 600, devices: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAXSERVE_LOGGING_LEVEL": "WARNING"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def precompiled(model_dir, bucket_file, tmp_path_factory):
    """(cache dir, stdout) of `scripts/precompile.py` run on the tiny model in its own process."""
    cache = tmp_path_factory.mktemp("cache") / "jax"
    result = _run([
        "scripts/precompile.py", "--model", str(model_dir), "--dtype", "float32", "--buckets", str(bucket_file),
        "--compile-cache-dir", str(cache), "--no-progress",
    ])
    return cache, result.stdout


# A second process: the engine from the cache, strict, counting every compile of the process.
ENGINE_PROBE = """
import json, sys
from jaxserve.compilation.compile_cache import compile_counts
before = compile_counts()
from jaxserve import LLM, SamplingParams
model, buckets, cache, strict = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "strict"
tp = int(sys.argv[7])
llm = LLM(model, dtype="float32", buckets=buckets, compile_cache_dir=cache, strict_no_compile=strict,
          tensor_parallel_size=tp)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[6]), ignore_eos=True)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[5])}], params, use_tqdm=False)[0]
counts = compile_counts() - before
engine = llm.llm_engine
report = engine.warm_up_report
print(json.dumps({
    "hits": report.num_cache_hits, "fresh": report.num_fresh, "sources": [c.source for c in report.compiles],
    "state": report.cache_check.state, "differences": list(report.cache_check.differences),
    "backend_compiles": counts.backend_compiles, "cache_hits": counts.cache_hits,
    "cache_writes": counts.cache_writes, "tokens": out.outputs[0].token_ids,
    "compiles_after_warm_up": engine.stats.num_compiles_after_warm_up,
    "store_loaded": engine.runner.executable_store.num_loaded,
    "store_saved": engine.runner.executable_store.num_saved,
}))
"""


def _probe_engine(model_dir, bucket_file, cache, mode: str, tensor_parallel_size: int = 1) -> dict:
    args = [str(model_dir), str(bucket_file), str(cache), mode, json.dumps(PROMPT), str(NEW_TOKENS)]
    result = _run(["-c", ENGINE_PROBE, *args, str(tensor_parallel_size)], devices=tensor_parallel_size)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# -- precompile, then start from the cache ----------------------------------------------------------


def test_precompile_compiles_every_bucket_fresh_and_records_the_manifest(precompiled, model_dir, bucket_file):
    cache, stdout = precompiled
    rows = [line.split() for line in stdout.splitlines() if line.startswith(("prefill b=", "decode  b=", "mixed   b="))]
    assert [" ".join(r[:-2]) for r in rows] == [" ".join(n.split()) for n in BUCKET_NAMES]
    assert [r[-1] for r in rows] == ["fresh"] * 4
    assert "4 buckets in " in stdout and ": 0 from the compile cache, 4 compiled fresh, 1 thread" in stdout
    assert "no manifest (not precompiled)" in stdout
    # 4 buckets, the sampler executables of their 2 batch sizes, the allocations of the KV pool, of
    # `no_tokens` and of the sampler state (3 distinct arrays), the 2 fork executables (copy_blocks, write_slot) and
    # the prompt logprobs'
    assert num_cache_entries(cache) == 14
    # The 4 buckets, 2 samplers, 2 fork executables and the prompt logprobs' are also stored serialized, under the
    # configuration's key.
    (store_dir,) = (cache / STORE_DIR_NAME).iterdir()
    assert sorted(p.name for p in store_dir.iterdir()) == [
        "copy_blocks.executable", "prompt-logprobs.executable", "sample-s1.executable", "sample-s2.executable",
        "step-s1-q1-p4.executable", "step-s1-q16-p4.executable", "step-s2-q1-p4.executable",
        "step-s2-t16-p4.executable", "write_slot.executable",
    ]
    (manifest,) = read_manifests(cache)
    assert store_dir.name == store_key(manifest)
    assert manifest.dtype == "float32" and manifest.platform == "cpu" and manifest.device_kind == "cpu"
    assert manifest.jax_version == jax.__version__
    assert manifest.engine_limits == {
        "block_size": 16, "num_kv_blocks": DEFAULT_CPU_KV_BLOCKS, "max_model_len": 64, "max_num_seqs": 2,
        "max_num_batched_tokens": 16, "mixed_token_limit": 16, "attention_backend": "cpu", "tensor_parallel_size": 1,
        "max_logprobs": 20, "kv_cache_dtype": "auto",
    }
    assert manifest.info["num_executables"] == 4 and manifest.info["written_by"] == "precompile"


def test_second_process_starts_from_the_cache_with_zero_fresh_compiles(precompiled, model_dir, bucket_file):
    cache, _ = precompiled
    probe = _probe_engine(model_dir, bucket_file, cache, "strict")
    assert probe["state"] == "match" and probe["differences"] == []
    assert probe["sources"] == ["cache hit"] * 4
    assert (probe["hits"], probe["fresh"]) == (4, 0)
    # The 4 buckets, 2 samplers, 2 fork executables and the prompt logprobs' are deserialized from the store:
    # neither lowered nor compiled. The process's only XLA compilations are the 5 allocation programs, all loaded
    # from JAX's cache.
    assert (probe["store_loaded"], probe["store_saved"]) == (9, 0)
    assert (probe["backend_compiles"], probe["cache_hits"], probe["cache_writes"]) == (5, 5, 0)
    assert probe["compiles_after_warm_up"] == 0
    assert probe["tokens"] == _hf_greedy(model_dir, PROMPT, NEW_TOKENS)  # loaded executables compute right
    assert num_cache_entries(cache) == 14


def test_changed_bucket_file_is_reported_and_only_new_buckets_compile(precompiled, model_dir, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(precompiled[0], cache)
    changed = tmp_path / "changed.toml"
    changed.write_text(SMALL_SPEC.replace("lengths = [16]", "lengths = [16, 32]"))
    probe = _probe_engine(model_dir, changed, cache, "lenient")
    assert probe["state"] == "stale"
    assert len(probe["differences"]) == 3
    assert probe["differences"][0].startswith("bucket_file_hash: cache has '")
    assert probe["differences"][1:] == ["max_num_batched_tokens: cache has 16, now 32",
                                        "mixed_token_limit: cache has 16, now 32"]  # follows the token budget
    assert probe["sources"] == ["cache hit", "fresh", "cache hit", "cache hit", "cache hit"]  # the new 1x32 prefill
    assert (probe["hits"], probe["fresh"]) == (4, 1)
    # Another configuration, another store key: only the fresh compile is stored; what JAX loaded from its
    # cache is not serialized again (on XLA:CPU that loses code: "Function ... not found" in the next process).
    assert (probe["store_loaded"], probe["store_saved"]) == (0, 1)
    assert probe["tokens"] == _hf_greedy(model_dir, PROMPT, NEW_TOKENS)
    # The engine recorded its configuration next to the precompiled one: both now start warm.
    assert [m.info["written_by"] for m in read_manifests(cache)] == ["precompile", "engine warm-up"]
    again = _probe_engine(model_dir, changed, cache, "strict")  # the stored and JAX-cached executables run right
    assert (again["state"], again["fresh"], again["store_loaded"], again["store_saved"]) == ("match", 0, 1, 0)
    assert again["tokens"] == _hf_greedy(model_dir, PROMPT, NEW_TOKENS)


def test_tensor_parallel_precompile_starts_with_zero_fresh_compiles(model_dir, bucket_file, tmp_path):
    """Two virtual CPU devices: the abstract params and pool carry the engine's shardings."""
    cache = tmp_path / "cache"
    result = _run([
        "scripts/precompile.py", "--model", str(model_dir), "--dtype", "float32", "--buckets", str(bucket_file),
        "--compile-cache-dir", str(cache), "--no-progress", "--tensor-parallel-size", "2",
    ], devices=2)
    assert ": 0 from the compile cache, 4 compiled fresh" in result.stdout
    (manifest,) = read_manifests(cache)
    assert manifest.engine_limits["tensor_parallel_size"] == 2
    probe = _probe_engine(model_dir, bucket_file, cache, "strict", tensor_parallel_size=2)
    assert probe["state"] == "match" and (probe["hits"], probe["fresh"]) == (4, 0)
    # loaded: 4 steps, 2 samplers, 2 forks, the prompt logprobs'
    assert (probe["store_loaded"], probe["backend_compiles"], probe["cache_hits"]) == (9, 5, 5)
    assert probe["tokens"] == _hf_greedy(model_dir, PROMPT, NEW_TOKENS)


# -- the manifest -----------------------------------------------------------------------------------


def _manifest(model_dir, bucket_file, **engine_kwargs) -> CacheManifest:
    engine_kwargs = {"dtype": "float32", **engine_kwargs}
    config = EngineConfig(model=str(model_dir), buckets=str(bucket_file), **engine_kwargs)
    model_config = load_config(Path(model_dir))
    params = abstract_params(model_config, config.dtype)
    grid = engine_bucket_grid(config, model_config, params, "cpu", make_mesh(1))
    return CacheManifest.current(model_config, config.dtype, grid, "cpu")  # what "auto" picks on CPU


def test_manifest_detects_changed_bucket_file_model_dtype_and_limits(precompiled, model_dir, bucket_file, tmp_path):
    cache, _ = precompiled
    assert check_manifest(cache, _manifest(model_dir, bucket_file)).state == "match"
    commented = tmp_path / "commented.toml"
    commented.write_text("# the same buckets, other comments\n" + SMALL_SPEC)
    assert check_manifest(cache, _manifest(model_dir, commented)).state == "match"

    more_contexts = tmp_path / "more.toml"
    more_contexts.write_text(SMALL_SPEC.replace("lengths = [64]", "lengths = [32, 64]"))
    check = check_manifest(cache, _manifest(model_dir, more_contexts))
    assert check.state == "stale" and len(check.differences) == 1
    assert check.differences[0].startswith("bucket_file_hash: cache has '")
    more_mixed = tmp_path / "more_mixed.toml"
    more_mixed.write_text(SMALL_SPEC.replace("token_counts = [16]", "token_counts = [16, 32]"))
    check = check_manifest(cache, _manifest(model_dir, more_mixed))  # the [mixed] table decides executables too
    assert check.state == "stale" and check.differences[0].startswith("bucket_file_hash: cache has '")

    other_model = make_tiny_model(tmp_path / "other", "llama", seed=3, num_hidden_layers=3)
    check = check_manifest(cache, _manifest(other_model, bucket_file))
    assert check.state == "stale" and len(check.differences) == 1
    assert check.differences[0].startswith("model_config_hash: cache has '")
    assert "Re-run `jaxserve precompile` with this configuration." in check.describe()

    same_shapes_other_weights = make_tiny_model(tmp_path / "reseeded", "llama", seed=4)
    assert check_manifest(cache, _manifest(same_shapes_other_weights, bucket_file)).state == "match"

    check = check_manifest(cache, _manifest(model_dir, bucket_file, dtype="bfloat16"))
    assert check.differences == ("dtype: cache has 'float32', now 'bfloat16'",)
    check = check_manifest(cache, _manifest(model_dir, bucket_file, num_kv_blocks=512))
    assert check.differences == (f"num_kv_blocks: cache has {DEFAULT_CPU_KV_BLOCKS}, now 512",)


def test_manifest_reports_a_foreign_device_and_an_empty_or_corrupt_directory(precompiled, model_dir, bucket_file,
                                                                             tmp_path):
    current = _manifest(model_dir, bucket_file)
    assert check_manifest(tmp_path, current).state == "empty"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    record_manifest(foreign, CacheManifest(**{**current.__dict__, "device_kind": "TPU v5 lite", "platform": "tpu"}))
    check = check_manifest(foreign, current)
    assert check.state == "foreign"
    assert check.differences == (
        "platform: cache has 'tpu', now 'cpu'", "device_kind: cache has 'TPU v5 lite', now 'cpu'"
    )
    record_manifest(foreign, current)  # the same directory now also holds this machine's executables
    assert check_manifest(foreign, current).state == "match"
    assert len(read_manifests(foreign)) == 2
    record_manifest(foreign, current)  # recording again replaces, never duplicates
    assert len(read_manifests(foreign)) == 2
    manifest_path(foreign).write_text("{not json")
    with pytest.raises(ValueError, match=r"^unreadable compile cache manifest .*jaxserve_manifest.json: "):
        check_manifest(foreign, current)


def test_executable_store_loads_only_matching_intact_executables(model_dir, bucket_file, tmp_path):
    store = ExecutableStore(tmp_path, _manifest(model_dir, bucket_file))
    args = (jax.ShapeDtypeStruct((3,), jnp.float32),)
    store.save("square", jax.jit(lambda x: x * x).lower(*args).compile())
    assert store.load("square", args)(np.arange(3, dtype=np.float32)).tolist() == [0.0, 1.0, 4.0]
    assert store.load("square", (jax.ShapeDtypeStruct((4,), jnp.float32),)) is None  # other shape
    assert store.load("square", (jax.ShapeDtypeStruct((3,), jnp.int32),)) is None  # other dtype
    assert store.load("square", (args[0], args[0])) is None  # other argument tree
    assert store.load("cube", args) is None  # never stored
    (store.directory / "square.executable").write_bytes(b"not an executable")
    assert store.load("square", args) is None  # damaged: the runner compiles instead
    assert (store.num_loaded, store.num_saved) == (1, 1)


def test_executable_store_skips_an_executable_that_calls_back_into_python(model_dir, bucket_file, tmp_path, caplog):
    """The Pallas kernels interpreted on CPU call back into Python, which cannot be serialized (pickle refuses
    the callback; sharded, JAX's serializer crashed the process). The store logs and skips it, and the caller
    keeps the compiled executable."""
    store = ExecutableStore(tmp_path, _manifest(model_dir, bucket_file))
    args = (jax.ShapeDtypeStruct((3,), jnp.float32),)

    def with_callback(x):
        return jax.pure_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct((3,), jnp.float32), x)

    compiled = jax.jit(with_callback).lower(*args).compile()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        store.save("callback", compiled)
    assert "cannot store executable callback (it calls back into Python)" in caplog.text
    assert store.num_saved == 0 and store.load("callback", args) is None
    assert compiled(np.zeros(3, np.float32)).tolist() == [1.0, 1.0, 1.0]


def test_store_key_covers_the_manifest_and_the_lowering_environment(model_dir, bucket_file, monkeypatch):
    manifest = _manifest(model_dir, bucket_file)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    key = store_key(manifest)
    assert store_key(_manifest(model_dir, bucket_file)) == key  # deterministic
    assert store_key(_manifest(model_dir, bucket_file, dtype="bfloat16")) != key
    assert store_key(_manifest(model_dir, bucket_file, num_kv_blocks=512)) != key
    assert store_key(CacheManifest(**{**manifest.__dict__, "step_code_hash": "0" * 64})) != key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
    assert store_key(manifest) != key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    with jax.default_matmul_precision("highest"):
        assert store_key(manifest) != key
    assert store_key(manifest) == key


@pytest.mark.parametrize(
    "family, dtype, overrides",
    [("llama", "float32", {}), ("qwen2", "bfloat16", {}), ("llama", "float32", {"tie_word_embeddings": True})],
)
def test_abstract_params_are_the_loaded_tree(tmp_path, family, dtype, overrides):
    path = make_tiny_model(tmp_path, family, seed=0, **overrides)
    loaded = load_model(str(path), dtype)
    abstract = abstract_params(loaded.config, dtype)
    assert jax.tree.structure(abstract) == jax.tree.structure(loaded.params)
    shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)
    assert shapes(abstract) == shapes(loaded.params)


# -- strict mode and counters -----------------------------------------------------------------------


def _engine_from_cache(model_dir, bucket_file, cache, strict: bool) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir), dtype="float32", buckets=str(bucket_file), compile_cache_dir=str(cache),
        strict_no_compile=strict,
    )
    engine = LLMEngine(config)
    assert (engine.warm_up_report.num_cache_hits, engine.warm_up_report.num_fresh) == (4, 0)
    return engine


def _compile_something_new_during_each_step(engine: LLMEngine) -> None:
    execute, calls = engine.runner.execute, [0]

    def execute_after_a_compile(*args, **kwargs):
        calls[0] += 1
        jax.jit(lambda x: x * calls[0]).lower(jax.ShapeDtypeStruct((calls[0],), jnp.float32)).compile()
        return execute(*args, **kwargs)

    engine.runner.execute = execute_after_a_compile


def test_strict_no_compile_raises_on_a_compile_after_warm_up(precompiled, model_dir, bucket_file, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(precompiled[0], cache)
    engine = _engine_from_cache(model_dir, bucket_file, cache, strict=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, params)
    engine.step()  # the prefill: nothing compiles
    engine.step()
    assert engine.stats.num_compiles_after_warm_up == 0
    _compile_something_new_during_each_step(engine)
    with pytest.raises(
        RuntimeError,
        match=r"^strict_no_compile: 1 XLA compilation\(s\) after warm-up, during a step on bucket "
        r"DecodeBucket\(batch_size=1, context_len=64\): warm-up did not cover this shape$",
    ):
        engine.step()
    assert engine.stats.num_compiles_after_warm_up == 1

    lenient = _engine_from_cache(model_dir, bucket_file, cache, strict=False)
    _compile_something_new_during_each_step(lenient)
    lenient.add_request("b", {"prompt_token_ids": PROMPT}, params)
    while lenient.has_unfinished_requests():
        lenient.step()
    assert lenient.stats.num_steps == 3  # one prefill, two decodes
    assert lenient.stats.num_compiles_after_warm_up == 3  # the metric: one per step


def test_counters_split_fresh_compiles_cache_hits_and_threads(tmp_path):
    enable_persistent_cache(tmp_path)

    def build():  # a new function object each time: only the persistent cache can answer
        return jax.jit(lambda x: jnp.tanh(x) * 3.25).lower(jax.ShapeDtypeStruct((7, 3), jnp.float32)).compile()

    before = thread_compile_counts()
    build()
    first = thread_compile_counts() - before
    assert (first.backend_compiles, first.cache_hits, first.cache_writes, first.fresh_compiles) == (1, 0, 1, 1)
    before = thread_compile_counts()
    build()
    second = thread_compile_counts() - before
    assert (second.backend_compiles, second.cache_hits, second.cache_writes, second.fresh_compiles) == (1, 1, 0, 0)
    assert num_cache_entries(tmp_path) == 1

    process_before, mine_before = compile_counts(), thread_compile_counts()
    other = threading.Thread(target=lambda: jax.jit(lambda x: x - 1.5).lower(np.float32(0)).compile())
    other.start()
    other.join()
    assert (thread_compile_counts() - mine_before).backend_compiles == 0  # another thread's compile
    assert (compile_counts() - process_before).backend_compiles == 1


# -- configuration and command line -----------------------------------------------------------------


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "jaxserve" / "compile_cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "jaxserve" / "compile_cache"


def test_resolve_cache_dir_default_env_explicit_and_disabled(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(None) == default_cache_dir() == tmp_path / "xdg" / "jaxserve" / "compile_cache"
    assert resolve_cache_dir(tmp_path / "mine") == resolve_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir("~/cc") == tmp_path / "home" / "cc"
    with pytest.raises(ValueError, match=r"^the persistent compile cache is disabled \(compile_cache_dir=''\), "
                       r"and precompiling needs a directory: pass --compile-cache-dir DIR"):
        resolve_cache_dir("", required=True)
    assert resolve_cache_dir("") is None

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "from-env"))
    assert resolve_cache_dir(None) == tmp_path / "from-env"
    assert resolve_cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"  # an explicit path wins
    assert resolve_cache_dir("") is None  # and so does an explicit ""

    monkeypatch.setenv(CACHE_DIR_ENV, "")  # set but empty: disabled (what tests/conftest.py sets)
    assert resolve_cache_dir(None) is None
    with pytest.raises(ValueError, match=r"^the persistent compile cache is disabled "
                       r"\(JAXSERVE_COMPILE_CACHE_DIR=''\), and precompiling needs a directory"):
        resolve_cache_dir(None, required=True)
    assert resolve_cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"


def test_engine_config_validates_cache_options(tmp_path):
    assert EngineConfig().compile_cache_dir is None  # kept as given: resolved when the engine starts
    assert EngineConfig(compile_cache_dir=tmp_path).compile_cache_dir == str(tmp_path)
    assert EngineConfig(compile_cache_dir="").compile_cache_dir == ""  # no persistent cache
    with pytest.raises(ValueError, match=r"^compile_cache_dir must be a directory path, got 3$"):
        EngineConfig(compile_cache_dir=3)
    with pytest.raises(ValueError, match=r"^compile_cache_dir must be a directory path, got b'c'$"):
        EngineConfig(compile_cache_dir=b"c")
    with pytest.raises(ValueError, match=r"^strict_no_compile must be True or False, got 'yes'$"):
        EngineConfig(strict_no_compile="yes")


def test_precompile_and_engine_flags_parse():
    args = build_parser().parse_args([
        "precompile", "--model", "m", "--dtype", "bfloat16", "--buckets", "b.toml", "--compile-cache-dir", "c",
        "--num-threads", "2", "--max-model-len", "256",
    ])
    assert (args.command, args.model, args.dtype, args.buckets, args.compile_cache_dir, args.num_threads) == (
        "precompile", "m", "bfloat16", "b.toml", "c", 2
    )
    args = build_parser().parse_args(["generate", "hi", "--compile-cache-dir", "c", "--strict-no-compile"])
    assert (args.compile_cache_dir, args.strict_no_compile) == ("c", True)
    args = build_parser().parse_args(["serve", "--compile-cache-dir", ""])
    assert engine_config_from_args(args).compile_cache_dir == ""  # disabled
    assert engine_config_from_args(build_parser().parse_args(["serve"])).compile_cache_dir is None  # the default
    script = (SCRIPTS / "precompile.py").read_text()
    assert 'main(["precompile", *sys.argv[1:]])' in script  # the script is the same command


def test_precompile_refuses_a_disabled_cache(monkeypatch):
    with pytest.raises(ValueError, match=r"\(compile_cache_dir=''\), and precompiling needs a directory"):
        precompile(EngineConfig(compile_cache_dir=""))
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    with pytest.raises(ValueError, match=r"\(JAXSERVE_COMPILE_CACHE_DIR=''\), and precompiling needs a directory"):
        precompile(EngineConfig())


# -- the default directory, end to end --------------------------------------------------------------


@contextlib.contextmanager
def _engine_log(caplog):
    """The `jaxserve` logger does not propagate to the root logger that caplog watches: listen on it."""
    caplog.set_level(logging.INFO, logger="jaxserve")
    logger = logging.getLogger("jaxserve")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def test_engine_uses_the_per_user_cache_by_default(model_dir, bucket_file, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = (tmp_path / "jaxserve" / "compile_cache").resolve()
    with _engine_log(caplog):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", buckets=str(bucket_file)))
    assert f"persistent compile cache: {expected}" in caplog.messages
    assert engine.compile_cache_dir == engine.warm_up_report.cache_dir == persistent_cache_dir() == expected
    assert num_cache_entries(expected) > 0  # JAX's entries
    (store_dir,) = (expected / STORE_DIR_NAME).iterdir()  # and the serialized buckets
    assert len(list(store_dir.glob("*.executable"))) == 9  # 4 buckets, 2 samplers, 2 forks, the prompt logprobs'
    (manifest,) = read_manifests(expected)
    assert manifest.info["written_by"] == "engine warm-up"


def test_engine_with_an_empty_cache_dir_turns_the_cache_off(model_dir, bucket_file, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "from-env"))  # the explicit "" wins over the variable
    enable_persistent_cache(tmp_path / "earlier")  # as an earlier engine of this process would have left it
    config = EngineConfig(model=str(model_dir), dtype="float32", buckets=str(bucket_file), compile_cache_dir="")
    with _engine_log(caplog):
        engine = LLMEngine(config, warm_up=False)
    assert "persistent compile cache: disabled (compile_cache_dir='' or JAXSERVE_COMPILE_CACHE_DIR='')" in (
        caplog.messages
    )
    assert engine.compile_cache_dir is None and persistent_cache_dir() is None
    assert not (tmp_path / "from-env").exists()
