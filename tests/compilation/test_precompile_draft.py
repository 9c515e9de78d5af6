"""Precompile with a draft model (`--speculative-config '{"model": ...}'`): the draft's programs are compiled into the
cache, so that an engine with the same draft started afterwards on it compiles nothing new; the KV pool is sized
with the draft, as the engine sizes it, also for a TPU topology compiled deviceless (computed, not
run: the engine's sizing is called with the target's memory and devices)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxserve.compilation import sizing, target_compile
from jaxserve.compilation.precompile import abstract_draft
from jaxserve.compilation.sizing import engine_bucket_grid
from jaxserve.compilation.target_compile import compile_for_target
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.speculative_config import SpeculativeConfig
from jaxserve.distributed.sharding import make_mesh
from jaxserve.speculative.draft_model import load_draft_model
from jaxserve.testing.tiny_models import make_tiny_model
from jaxserve.weights import load_model
from tests.compilation.test_compile_cache import SMALL_SPEC, _hf_greedy
from tests.paths import REPO_ROOT

K = 2
SPEC = SMALL_SPEC
PROMPT = [5, 9, 17, 33, 65, 129]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft): tiny random llamas of one vocabulary, the draft of one narrow layer; heads of 64 (the TPU
    kernels' smallest)."""
    tmp = tmp_path_factory.mktemp("models")
    return (make_tiny_model(tmp / "target", "llama", seed=3, hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1),
            make_tiny_model(tmp / "draft", "llama", seed=8, num_hidden_layers=1, num_attention_heads=1,
                            num_key_value_heads=1))


@pytest.fixture(scope="module")
def bucket_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("buckets") / "small.toml"
    path.write_text(SPEC)
    return path


def _run(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAXSERVE_LOGGING_LEVEL": "WARNING"}
    result = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# The engine with the draft, from the cache, strict, counting every compile of its process.
ENGINE_PROBE = """
import json, sys
from jaxserve.compilation.compile_cache import compile_counts
before = compile_counts()
from jaxserve import LLM, SamplingParams
model, buckets, cache, draft, k = sys.argv[1:6]
llm = LLM(model, dtype="float32", buckets=buckets, compile_cache_dir=cache, strict_no_compile=True,
          speculative_config={"model": draft, "num_speculative_tokens": int(k)})
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[6])}], params, use_tqdm=False)[0]
counts = compile_counts() - before
engine = llm.llm_engine
print(json.dumps({
    "backend_compiles": counts.backend_compiles, "fresh_compiles": counts.fresh_compiles,
    "draft_compiles": engine.proposer.runner.num_compiles, "draft_buckets": len(engine.proposer.buckets),
    "draft_tokens": engine.stats.num_spec_draft_tokens, "tokens": out.outputs[0].token_ids,
    "compiles_after_warm_up": engine.stats.num_compiles_after_warm_up,
}))
"""


def test_an_engine_with_the_draft_starts_on_the_precompiled_cache_without_compiling(models, bucket_file, tmp_path):
    target, draft = models
    cache = tmp_path / "cache"
    speculative = json.dumps({"model": str(draft), "num_speculative_tokens": K})
    stdout = _run(["scripts/precompile.py", "--model", str(target), "--dtype", "float32", "--buckets",
                   str(bucket_file), "--compile-cache-dir", str(cache), "--no-progress",
                   "--speculative-config", speculative])
    # the draft's grid: decode b=1 and b=2, mixed b=2 of 4, 8 and 16 tokens (the verification sizes of K=2)
    assert "draft model: 5 buckets in " in stdout
    assert ": 0 from the compile cache, 5 compiled fresh" in stdout
    probe = json.loads(_run(["-c", ENGINE_PROBE, str(target), str(bucket_file), str(cache), str(draft), str(K),
                             json.dumps(PROMPT)]).strip().splitlines()[-1])
    assert (probe["draft_buckets"], probe["draft_compiles"]) == (5, 7)  # the draft's 5 steps and 2 samplers
    # every executable of the process was compiled by precompile: the target's 5 allocations, the draft's 7 programs
    # and its 4 allocations (its pool and sampler state; `no_tokens` is the target's), all from JAX's cache (the
    # target's steps come from the executable store)
    assert (probe["backend_compiles"], probe["fresh_compiles"], probe["compiles_after_warm_up"]) == (16, 0, 0)
    assert probe["draft_tokens"] > 0 and probe["tokens"] == _hf_greedy(target, PROMPT, 8)  # the draft drafted


@pytest.fixture(scope="module")
def draft_config(models, bucket_file):
    target, draft = models
    spec = SpeculativeConfig.from_dict({"model": str(draft), "num_speculative_tokens": K})
    return EngineConfig(model=str(target), dtype="float32", buckets=str(bucket_file), speculative_config=spec)


@pytest.fixture(scope="module")
def engine_loaded(models):
    """The target and the draft as an engine loads them (`build_engine_parts`)."""
    target, draft = models
    loaded = load_model(str(target), "float32")
    return loaded, load_draft_model(str(draft), loaded.config, "float32", make_mesh(1))


def _engine_grid(config, engine_loaded, platform, mesh, memory):
    """The grid `build_engine_parts` sizes on a device of ``memory`` bytes: the engine's call, with the draft."""
    loaded, draft = engine_loaded
    return engine_bucket_grid(config, loaded.config, loaded.params, platform, mesh, memory,
                              draft=(draft.config, draft.params))


def test_the_steps_are_fitted_beside_the_draft_models_weights_and_pool(draft_config, engine_loaded, monkeypatch):
    """Off CPU the pool gives back what the largest steps need; while they run the draft's weights and its pool are on
    the device too, not among their arguments: `blocks_over_budget` gets them beside (its part that scales with the
    pool is in the bytes per block)."""
    loaded, draft = engine_loaded
    seen = []
    monkeypatch.setattr(sizing, "blocks_over_budget", lambda *args, beside_bytes: seen.append(beside_bytes) or (0, 0))
    _engine_grid(draft_config, engine_loaded, "gpu", make_mesh(1), 64 << 20)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(draft.params))
    probe_pool = 4 * 2 * 16 * 64 * 4  # the probe's 4 blocks (one 64-token sequence) of K and V: 1 layer, 1 head of 64
    assert seen == [weights + probe_pool]


@pytest.fixture(scope="module")
def target_engines():
    """`target_engine` remembering what it built for these tests: sizing the v5e:2x2 grid compiles its largest steps
    for the TPU (the better part of the two deviceless tests' time), and both tests size the same engine, the second
    inside `compile_for_target`. The engines it built, by their arguments."""
    built, build = {}, target_compile.target_engine

    def remembered(*args, **kwargs):
        arguments = inspect.signature(build).bind(*args, **kwargs)
        arguments.apply_defaults()
        key = repr(arguments.arguments)
        if key not in built:
            built[key] = build(*args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target_compile, "target_engine", remembered)
        yield built


def test_a_deviceless_tpu_target_sizes_the_pool_with_the_draft_as_the_engine(draft_config, engine_loaded,
                                                                              target_engines):
    loaded, draft = engine_loaded
    assert abstract_draft(draft_config, loaded.config)[0] == draft.config
    built = target_compile.target_engine(draft_config, "v5e:2x2")
    target = built.target
    engine = _engine_grid(built.config, engine_loaded, target.platform, built.mesh, target.hbm_bytes_per_device)
    assert built.grid.num_blocks == engine.num_blocks
    assert jax.default_backend() == "cpu"  # computed here, not run on the target


def _draft_programs(report, page: str) -> list[str]:
    """The draft's programs of a one-bucket ``report``: its decode step of one row, its sampler, its allocations (its
    pool: 1 layer, 1 kv head, the grid's blocks of ``page``)."""
    pool = f"1x1x{report.grid.num_blocks}x{page}-float32"
    return ["draft step-s1-q1-p4", "draft sample-s1", f"draft zeros-{pool}", "draft zeros-2-int32",
            "draft zeros-1x320-int32", "draft zeros-1x320-bool", "draft zeros-1x320-float32"]


def test_a_deviceless_tpu_target_compiles_the_draft_models_programs_unstored(draft_config, tmp_path, target_engines):
    """`precompile --target` builds the draft's programs for the target too, reported as "draft ..." programs (its
    buckets capped like the target's); none is stored (the engine's warm-up reads them through JAX's persistent
    cache, and the store's names are the target's). Its engine is the one the test above sized (`target_engines`)."""
    cache = tmp_path / "cache"
    report = compile_for_target(draft_config, "v5e:2x2", max_buckets=1, cache_dir=str(cache))
    assert any(built.grid is report.grid for built in target_engines.values())
    assert report.failures() == []
    assert [p.name for p in report.programs if p.name.startswith("draft ")] == _draft_programs(report, "8x128")
    assert all(p.total_bytes > 0 for p in report.programs)
    assert "draft step-s1-q1-p4" in report.format_table()
    stored = sorted(p.name for p in (cache / "jaxserve_executables").rglob("*.executable"))
    assert stored == ["copy_blocks.executable", "prompt-logprobs.executable", "sample-s1.executable",
                      "step-s1-q16-p4.executable", "write_slot.executable"]  # the target's only


def test_a_cuda_target_lowers_the_draft_models_programs(draft_config):
    report = compile_for_target(draft_config, "cuda", max_buckets=1)
    assert report.target.lower_only and report.failures() == []
    assert [p.name for p in report.programs if p.name.startswith("draft ")] == _draft_programs(report, "16x64")
