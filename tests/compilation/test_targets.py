"""Compiling for hardware this host does not have (`jaxserve precompile --target`): the embedded model on a
small TPU grid compiled deviceless for v5e (real TPU compiler and Mosaic), every program fits and its
serialized executable and manifest are stored; the decode step updates the stacked pool in place (no
temporary of a layer's pool size); a Llama-3-8B-shaped config at tensor parallel 4 over v5e:2x2 on
representative buckets; the GPU grid's programs lowered for CUDA through the Triton kernels; every program of
the default TPU and GPU grids counted (and listed by `--list`) without compiling any; the CLI's exit code and
errors. The full grids run in `scripts/check_targets.py` (docs/benchmarks/targets.md)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.compilation.compile_cache import read_manifests
from jaxserve.compilation.executable_store import STORE_DIR_NAME
from jaxserve.compilation.program_list import Program, count_by_kind, format_program_list
from jaxserve.compilation.sizing import largest_of_each_kind
from jaxserve.compilation.target_compile import compile_for_target, plan_for_target, target_dtype
from jaxserve.compilation.targets import auto_tensor_parallel_size, resolve_target
from jaxserve.config.engine_config import EngineConfig
from jaxserve.entrypoints.cli import main
from jaxserve.runner.input_batch import StepShape
from jaxserve.runner.model_runner import executable_name
from tests.paths import load_script

LLAMA3_8B = load_script("check_targets").LLAMA3_8B  # the same config the full-grid check compiles
# One bucket of each kind, pages of 64 tokens as in buckets/tpu.toml.
SMALL_TPU_GRID = """
block_size = 64
[decode]
batch_sizes = [8]
[prefill]
batch_sizes = [1]
lengths = [128]
[context]
lengths = [512]
[mixed]
batch_sizes = [8]
token_counts = [128]
"""


@pytest.fixture(scope="module")
def small_grid(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grid") / "small_tpu.toml"
    path.write_text(SMALL_TPU_GRID)
    return path


@pytest.fixture(scope="module")
def llama3_8b_dir(tmp_path_factory) -> Path:
    """A directory with only config.json: the target compile needs shapes, never weights."""
    path = tmp_path_factory.mktemp("llama3-8b-shaped")
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return path


@pytest.fixture(scope="module")
def embedded_v5e(small_grid, tmp_path_factory):
    cache = tmp_path_factory.mktemp("v5e-cache")
    config = EngineConfig(model=None, buckets=str(small_grid), max_model_len=512, max_num_seqs=8)
    return compile_for_target(config, "v5e:2x2", cache_dir=str(cache)), cache


def test_embedded_model_compiles_for_v5e_and_every_program_fits(embedded_v5e):
    report, cache = embedded_v5e
    assert report.target.device_kind == "TPU v5 lite" and len(report.target.devices) == 4
    assert report.tensor_parallel_size == 1  # SmolLM2's 3 kv heads do not split over 2 or 4 chips
    names = [p.name for p in report.programs]
    assert names[:3] == ["step-s1-q128-p8", "step-s8-q1-p8", "step-s8-t128-p8"]
    assert names[3:5] == ["sample-s1", "sample-s8"]  # one per batch size of the steps
    assert {"copy_blocks", "write_slot", "prompt-logprobs"} <= set(names)
    assert report.failures() == []
    pool_bytes = 2 * report.grid.num_blocks * 64 * 3 * 64 * 30 * 2  # K and V, bfloat16
    steps = [p for p in report.programs if p.name.startswith("step-")]
    assert all(pool_bytes <= p.argument_bytes and p.alias_bytes >= pool_bytes for p in steps)  # donated in place
    assert all(p.total_bytes <= report.target.hbm_bytes_per_device for p in report.programs)
    # the pool left room for the largest step's temporaries, code and outputs, and hardly more: the probe compiles
    # the steps against a small pool and adds the rest, which comes out a little above the final executables' need
    usable = 0.9 * report.target.hbm_bytes_per_device  # gpu_memory_utilization
    block_bytes = 2 * 30 * 3 * 64 * 64 * 2  # K and V of one 64-token block, every layer, bfloat16
    largest = max(p.total_bytes for p in report.programs)
    assert largest <= usable < largest + 2 * block_bytes, (largest, usable)
    table = report.format_table()
    assert "compiled for v5e:2x2 (TPU v5 lite, 4 devices, tensor parallel 1)" in table
    assert "every program fits" in table
    stored = sorted(p.name for p in (cache / STORE_DIR_NAME).glob("*/*.executable"))
    stored_names = names[:5] + ["copy_blocks", "write_slot", "prompt-logprobs"]
    assert stored == sorted(f"{name}.executable" for name in stored_names)
    (manifest,) = read_manifests(cache)
    assert (manifest.platform, manifest.device_kind) == ("tpu", "TPU v5 lite")
    assert manifest.info["written_by"] == "precompile --target v5e:2x2"


def test_decode_step_updates_the_stacked_pool_in_place(embedded_v5e):
    """No temporary as large as one layer's pages: the kernels read the stacked pool at the layer index, the
    K/V write scatters into it, and the lane-dense layout needs no relayout copy."""
    report, _ = embedded_v5e
    one_layer_pool = 2 * report.grid.num_blocks * 64 * 3 * 64 * 2  # K and V of one layer, bfloat16
    decode = next(p for p in report.programs if p.name == "step-s8-q1-p8")
    assert decode.temp_bytes < one_layer_pool / 4, (decode.temp_bytes, one_layer_pool)


def test_llama3_8b_shape_compiles_at_tensor_parallel_4_on_v5e(llama3_8b_dir, small_grid):
    # a given pool (1024 blocks, 2.1 GB per chip) skips the probe compiles that size it (the embedded model's test
    # checks that sizing): three more compiles of the largest steps
    config = EngineConfig(model=str(llama3_8b_dir), buckets=str(small_grid), max_model_len=512, max_num_seqs=8,
                          num_kv_blocks=1024)
    report = compile_for_target(config, "v5e:2x2", cache_dir="", max_buckets=2)
    assert report.tensor_parallel_size == 4
    assert [p.name for p in report.programs[:2]] == ["step-s1-q128-p8", "step-s8-q1-p8"]
    assert report.failures() == []
    weights_per_chip = 8.03e9 * 2 / 4  # bfloat16, split four ways (embeddings and norms replicated: a bit more)
    pool_per_chip = 1024 * 2 * 32 * 8 * 64 * 128 * 2 / 4  # K and V, 32 layers, 8 kv heads of 128, split four ways
    step = report.programs[1]
    assert weights_per_chip + pool_per_chip < step.argument_bytes < report.target.hbm_bytes_per_device


def test_gpu_grid_lowers_for_cuda(small_grid):
    config = EngineConfig(model=None, buckets="gpu", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256)
    report = compile_for_target(config, "cuda", max_buckets=3)
    assert report.target.lower_only
    assert report.failures() == []
    # three steps, the samplers of their batch sizes, five allocations, two forks, the prompt logprobs'
    sizes = {p.name.split("-")[1] for p in report.programs if p.name.startswith("step-")}
    assert sorted(p.name for p in report.programs if p.name.startswith("sample-")) == sorted(
        f"sample-{s}" for s in sizes)
    assert len(report.programs) == 3 + len(sizes) + 8
    table = report.format_table()
    assert "lowered for cuda" in table and table.endswith("every program lowered")
    # dtype auto means the GPU's: bfloat16 for its tensor cores, whatever this CPU has
    assert target_dtype(config, report.target).dtype == "bfloat16"


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_lane_dense_pool_removes_the_relayout_of_the_pool(topology):
    """The issue's float32 decode call (batch 8, 9/3 heads, 2048 pages of 16 x 64): the plain pool is copied
    whole before the kernel (2 or 3 pool-shaped copies, >= 2x the pool in bytes accessed); lane-dense none."""
    layouts = load_script("tpu_kernel_layouts")
    plain = layouts.compile_decode(topology, jnp.float32, 1, lane_dense=False)
    dense = layouts.compile_decode(topology, jnp.float32, 1, lane_dense=True)
    cost = lambda c: (c.cost_analysis() if isinstance(c.cost_analysis(), dict) else c.cost_analysis()[0])
    pool = layouts.pool_bytes(1, jnp.float32)
    assert layouts.pool_copies(plain) >= 2 and cost(plain)["bytes accessed"] >= 2 * pool
    assert layouts.pool_copies(dense) == 0 and dense.memory_analysis().temp_size_in_bytes == 0
    assert cost(dense)["bytes accessed"] < pool / 100


def test_largest_of_each_kind():
    shapes = [StepShape(1, 128, 8), StepShape(16, 2048, 128), StepShape(4, 2048, 128), StepShape(8, 1, 8),
              StepShape(256, 1, 128), StepShape(64, 2048, 128, ragged=True), StepShape(256, 256, 8, ragged=True)]
    assert largest_of_each_kind(shapes) == [shapes[1], shapes[4], shapes[5]]


def test_target_names_and_tensor_parallel_choice():
    assert auto_tensor_parallel_size(4, 9, 3, 1536) == 1
    assert auto_tensor_parallel_size(4, 32, 8, 14336) == 4
    assert auto_tensor_parallel_size(8, 12, 4, 4096) == 4
    assert resolve_target("v6e:2x2").device_kind == "TPU v6 lite"
    with pytest.raises(ValueError, match=re.escape("cannot compile for TPU topology 'v9z:2x2'")):
        resolve_target("v9z:2x2")


def test_cli_refuses_to_compile_cuda_without_a_gpu(capsys):
    with pytest.raises(SystemExit, match="use --target cuda --lower-only"):
        main(["precompile", "--target", "cuda"])


def test_cli_exits_1_naming_the_programs_that_do_not_fit(tmp_path, capsys):
    """A KV pool of 12000 pages of 64 tokens (17.7 GB) on one v5e chip (15.75 GiB of HBM); a grid of one prefill
    and one decode bucket."""
    grid = tmp_path / "two_buckets.toml"
    grid.write_text(SMALL_TPU_GRID.split("[mixed]")[0].replace("batch_sizes = [8]", "batch_sizes = [1]", 1))
    code = main([
        "precompile", "--target", "v5e:2x2", "--buckets", str(grid), "--max-model-len", "512",
        "--max-num-seqs", "1", "--num-kv-blocks", "12000", "--compile-cache-dir", "",
    ])
    out = capsys.readouterr().out
    assert code == 1
    assert re.search(r"failed:\n  step-s1-q128-p8: ", out), out[-3000:]
    assert "KV pool 12000 blocks of 64 tokens" in out


# Every program of the default grids at max_model_len 8192 and the engine's defaults (max_num_seqs 256, 16 x 2048
# batched tokens): one context length, so one step per decode batch size, prefill (batch, chunk) and mixed (rows,
# tokens); a sampler per batch size; the pool's, no_tokens' and the sampler state's three allocations; two forks;
# the prompt logprobs' program.
TPU_PROGRAMS = {"prefill step": 9, "decode step": 6, "mixed step": 8, "sampler": 8, "allocation": 5, "fork": 2,
                "prompt logprobs": 1}
GPU_PROGRAMS = {"prefill step": 9, "decode step": 7, "mixed step": 8, "sampler": 7, "allocation": 5, "fork": 2,
                "prompt logprobs": 1}


@pytest.mark.parametrize(("target", "model", "expected"), [
    ("v5e:2x2", "embedded", TPU_PROGRAMS), ("v6e:2x2", "embedded", TPU_PROGRAMS),
    ("v5e:2x2", "llama3-8b", TPU_PROGRAMS), ("v6e:2x2", "llama3-8b", TPU_PROGRAMS),
    ("cuda", "embedded", GPU_PROGRAMS),
])
def test_default_grids_have_at_most_40_programs(target, model, expected, llama3_8b_dir):
    config = EngineConfig(model=None if model == "embedded" else str(llama3_8b_dir), max_model_len=8192)
    plan = plan_for_target(config, target, fit_to_steps=False)
    assert plan.built.grid.max_model_len == 8192 and plan.built.grid.max_num_batched_tokens == 16 * 2048
    assert count_by_kind(plan.programs) == expected
    assert len(plan.programs) == 39
    assert len({p.name for p in plan.programs}) == 39  # every name once
    assert plan.runner.num_compiles == 0  # counted, not compiled
    # with vLLM's 8192 batched tokens the 16 x 2048 prefill is pruned: 37
    smaller = plan_for_target(dataclasses.replace(config, max_num_batched_tokens=8192), target, fit_to_steps=False)
    assert count_by_kind(smaller.programs) == {**expected, "prefill step": 8}


def test_cli_lists_the_programs_and_compiles_nothing(capsys):
    assert main(["precompile", "--target", "v5e:2x2", "--list", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = ("39 programs to compile for v5e:2x2: 9 prefill steps, 6 decode steps, 8 mixed steps, 8 samplers, "
              "5 allocations, 2 forks, 1 prompt logprobs")
    assert out[1] == header
    listed = [line.split() for line in out[2:41]]
    assert listed[0] == ["step-s1-q128-p128", "prefill", "step"]
    assert listed[9] == ["step-s8-q1-p128", "decode", "step"]
    assert listed[22] == ["step-s256-t2048-p128", "mixed", "step"]
    assert [name for name, *_ in listed[23:31]] == [f"sample-s{b}" for b in (1, 4, 16, 8, 32, 64, 128, 256)]
    assert [name for name, *_ in listed[36:38]] == ["copy_blocks", "write_slot"]
    assert listed[38] == ["prompt-logprobs", "prompt", "logprobs"]
    assert out[41].startswith("compiled nothing")
    assert len(out) == 42


def test_cli_list_needs_a_target():
    with pytest.raises(SystemExit, match="--list needs --target"):
        main(["precompile", "--list"])


def test_program_list_counts_each_kind_in_order():
    programs = [Program("step-s1-q1-p8", "decode step"), Program("step-s8-q1-p8", "decode step"),
                Program("sample-s1", "sampler"), Program("draft step-s1-q1-p8", "draft decode step")]
    assert count_by_kind(programs) == {"decode step": 2, "sampler": 1, "draft decode step": 1}
    assert format_program_list(programs, "to lower for cuda").splitlines() == [
        "4 programs to lower for cuda: 2 decode steps, 1 sampler, 1 draft decode step",
        "  step-s1-q1-p8        decode step",
        "  step-s8-q1-p8        decode step",
        "  sample-s1            sampler",
        "  draft step-s1-q1-p8  draft decode step",
    ]


def test_a_target_sizes_and_builds_kv_cache_groups_as_the_engine_does(tmp_path):
    """gpt-oss-20b's 12 sliding and 12 full layers on v6e:2x2 (planned, nothing compiled): two groups of 12 layers,
    so a block holds half the bytes and the same memory twice the blocks of one group; the steps take both tables."""
    (tmp_path / "config.json").write_text(json.dumps(load_script("check_targets").GPT_OSS_20B))
    groups, one_group = (
        plan_for_target(EngineConfig(model=str(tmp_path), max_model_len=8192, disable_hybrid_kv_cache_manager=off),
                        "v6e:2x2", fit_to_steps=False) for off in (False, True))
    assert groups.runner.kv_pool[0].shape[:2] == (12, 8) and one_group.runner.kv_pool[0].shape[:2] == (24, 8)
    assert groups.built.grid.num_blocks // 2 == one_group.built.grid.num_blocks
    decode = next(shape for shape in groups.shapes if shape.kind == "decode")
    _, step_args = groups.runner.programs([decode], forks=False)[executable_name(decode)]
    meta = step_args[5]
    assert meta.block_tables.shape == (2, decode.batch_size, decode.pages_per_seq)
