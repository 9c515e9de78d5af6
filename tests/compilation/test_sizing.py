"""The KV pool's memory budget off CPU (`jaxserve/compilation/sizing.py`): weights already on the device are
counted once, and the pool gives back exactly the blocks its largest step overshoots the budget by. Host only:
the device's memory statistics and the compiled steps are stand-ins (tests/compilation/test_targets.py compiles
real ones for TPU)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.compilation.sizing import (
    MemoryBudget,
    blocks_over_budget,
    check_request_fits,
    cpu_kv_blocks,
    kv_bytes_per_block,
    kv_cache_summary,
    largest_samplers,
    memory_budget,
    num_blocks_from_budget,
)
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_cache_groups import layout_for
from jaxserve.config.model_config import ModelConfig
from jaxserve.runner.input_batch import SampleShape, StepShape

ONE_GROUP = layout_for((False,) * 18, None)  # every layer keeps every token


@pytest.fixture
def device_with_300_of_1000_bytes_in_use(monkeypatch):
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 1000, "bytes_in_use": 300})
    monkeypatch.setattr(jax, "local_devices", lambda: [device])


def test_weights_already_on_the_device_are_not_counted_twice(device_with_300_of_1000_bytes_in_use):
    on_device, on_host = {"w": jnp.zeros(4)}, {"w": np.zeros(4)}
    assert memory_budget(0.9, on_device, weights_bytes=200).usable_bytes == 900 - (300 - 200)
    assert memory_budget(0.9, on_host, weights_bytes=200).usable_bytes == 900 - 300
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    assert memory_budget(0.5, abstract, weights_bytes=200, device_memory_bytes=4000).usable_bytes == 2000
    assert MemoryBudget(900).pool_bytes(weights_bytes=200, sampler_state_bytes=50) == 650


class _Compiled:
    def __init__(self, temp: int):
        self.memory = types.SimpleNamespace(argument_size_in_bytes=1000, output_size_in_bytes=30,
                                            alias_size_in_bytes=20, temp_size_in_bytes=temp,
                                            generated_code_size_in_bytes=5)

    def memory_analysis(self):
        return self.memory


class _Runner:
    """Steps and samplers whose temporaries are given per shape, beside ``resident`` bytes of weights and pool, and
    (``prompt_logprobs_temp``) the prompt logprobs' program; records what was compiled."""

    def __init__(self, temps: dict[StepShape | SampleShape, int], num_blocks: int, resident: int,
                 prompt_logprobs_temp: int | None = None):
        self.temps, self.compiled, self.num_blocks, self.resident = temps, [], num_blocks, resident
        self.prompt_positions = None if prompt_logprobs_temp is None else "positions"
        self.prompt_logprobs_temp = prompt_logprobs_temp

    def compile_prompt_logprobs(self) -> _Compiled:
        self.compiled.append("prompt-logprobs")
        return _Compiled(self.prompt_logprobs_temp)

    def compile(self, shape: StepShape) -> _Compiled:
        self.compiled.append(shape)
        return _Compiled(self.temps[shape])

    compile_sampler = compile

    def resident_bytes(self) -> int:
        return self.resident


def test_the_pool_gives_back_the_blocks_its_largest_step_overshoots_by():
    prefill, small_prefill, decode = StepShape(4, 64, 8), StepShape(1, 64, 8), StepShape(8, 1, 8)
    temps = {prefill: 400, small_prefill: 10_000, decode: 100, SampleShape(8): 0, SampleShape(1): 10_000}
    runner = _Runner(temps, num_blocks=2, resident=300)
    # only the largest of each kind is compiled; with the probe's 2 blocks it needs 1000 + 30 - 20 + 400 + 5 = 1415
    # bytes, with a pool of 10 blocks of 100 bytes 800 more; the sampler of 8 rows 1015 + the resident 300 = 1315
    shapes = [small_prefill, prefill, decode]
    assert blocks_over_budget(runner, shapes, MemoryBudget(2000), 100, pool_blocks=10) == (3, 2215)
    assert runner.compiled == [prefill, decode, SampleShape(8)]
    assert blocks_over_budget(runner, shapes, MemoryBudget(2115), 100, pool_blocks=10) == (1, 2215)
    assert blocks_over_budget(runner, shapes, MemoryBudget(2215), 100, pool_blocks=10) == (0, 2215)
    assert blocks_over_budget(runner, shapes, MemoryBudget(1200), 100, pool_blocks=2) == (3, 1415)


def test_a_draft_models_weights_and_pool_beside_the_steps_are_counted():
    prefill, decode = StepShape(4, 64, 8), StepShape(8, 1, 8)
    runner = _Runner({prefill: 400, decode: 100, SampleShape(8): 0, SampleShape(1): 0}, num_blocks=2, resident=300)
    # the largest step's 1415 bytes with the probe's 2 blocks, 800 more with 10 blocks, and 250 bytes beside
    assert blocks_over_budget(runner, [prefill, decode], MemoryBudget(2000), 100, pool_blocks=10,
                              beside_bytes=250) == (5, 2465)


def test_a_sampler_beside_the_weights_and_pool_can_be_what_overshoots():
    decode = StepShape(8, 1, 8)
    runner = _Runner({decode: 100, SampleShape(8): 0}, num_blocks=2, resident=600)
    # the step: 1115 bytes; the sampler: 1015 + 600 resident = 1615, and 800 more with 10 blocks
    assert blocks_over_budget(runner, [decode], MemoryBudget(2000), 100, pool_blocks=10) == (5, 2415)


def test_the_prompt_logprobs_program_beside_the_weights_and_pool_can_be_what_overshoots():
    decode = StepShape(8, 1, 8)
    runner = _Runner({decode: 100, SampleShape(8): 0}, num_blocks=2, resident=600, prompt_logprobs_temp=700)
    # the step: 1115 bytes; the sampler: 1015 + 600 = 1615; the prompt logprobs: its outputs, temporaries and code
    # (30 - 20 + 700 + 5; its arguments are resident) + the resident 600 = 1315; the largest, 800 more with 10 blocks
    assert blocks_over_budget(runner, [decode], MemoryBudget(2000), 100, pool_blocks=10) == (5, 2415)
    runner.prompt_logprobs_temp = 1200  # now it is the largest: 30 - 20 + 5 + 1200 + 600 = 1815, and 800 more
    assert blocks_over_budget(runner, [decode], MemoryBudget(2000), 100, pool_blocks=10) == (7, 2615)
    assert runner.compiled.count("prompt-logprobs") == 2


def test_largest_samplers_are_the_most_rows_of_plain_and_verifying_steps():
    shapes = [StepShape(16, 1, 8), StepShape(4, 16, 8, ragged=True, num_sample_positions=12, num_speculative_tokens=2),
              StepShape(64, 1, 8), StepShape(8, 32, 8, ragged=True, num_sample_positions=24, num_speculative_tokens=2),
              StepShape(1, 64, 8)]
    assert largest_samplers(shapes) == [SampleShape(64), SampleShape(8, 24, 2)]


def test_kv_bytes_per_block():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bf16, 16-token pages
    assert kv_bytes_per_block(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype_bytes=2) == (
        2 * 30 * 3 * 16 * 64 * 2
    )


def test_num_blocks_from_budget():
    def size(num_kv_blocks=None, memory_budget_bytes=None, bytes_per_block=1000):
        return num_blocks_from_budget(
            bytes_per_block,
            num_kv_blocks=num_kv_blocks,
            memory_budget_bytes=memory_budget_bytes,
            default_cpu_blocks=3,
        )

    assert size(num_kv_blocks=7, memory_budget_bytes=10**9) == 7  # explicit wins
    assert size(memory_budget_bytes=10_999) == 10
    assert size() == 3
    msg = r"^no memory left for the KV cache: the budget is 999 bytes \(0.0 MiB\) but one block needs 1000"
    with pytest.raises(ValueError, match=msg):
        size(memory_budget_bytes=999)
    with pytest.raises(ValueError, match="budget is -5 bytes"):
        size(memory_budget_bytes=-5)
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 1, got 0"):
        size(num_kv_blocks=0)
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1"):
        size(bytes_per_block=0)


def test_kv_cache_memory_bytes_sizes_the_pool_before_the_budget_and_the_cpu_default():
    def size(**kwargs):
        options = dict(num_kv_blocks=None, memory_budget_bytes=10**9, default_cpu_blocks=3) | kwargs
        return num_blocks_from_budget(1000, **options)

    assert size(kv_cache_memory_bytes=12_999) == 12  # vLLM's option: the budget's share is not used
    assert size(kv_cache_memory_bytes=12_999, memory_budget_bytes=None) == 12  # nor the CPU default
    assert size(kv_cache_memory_bytes=12_999, num_kv_blocks=5) == 5
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes=999 holds no KV block: one needs 1000 bytes per "
                                         r"device \(0.00 MiB\)$"):
        size(kv_cache_memory_bytes=999)


def test_the_engine_config_takes_one_of_num_kv_blocks_and_kv_cache_memory_bytes():
    from jaxserve.config.engine_config import EngineConfig

    assert EngineConfig(kv_cache_memory_bytes=2**30).kv_cache_memory_bytes == 2**30
    with pytest.raises(ValueError, match=r"^give num_kv_blocks or kv_cache_memory_bytes, not both"):
        EngineConfig(num_kv_blocks=8, kv_cache_memory_bytes=2**30)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^kv_cache_memory_bytes must be a positive integer, got {bad!r}$"):
            EngineConfig(kv_cache_memory_bytes=bad)


def test_the_cli_reads_vllms_human_readable_bytes():
    import argparse

    from jaxserve.entrypoints.args import add_engine_args, engine_config_from_args, human_readable_int

    assert [human_readable_int(x) for x in ("4096", "4k", "4K", "1.5g", "2G", "1T")] == [
        4096, 4000, 4096, 1_500_000_000, 2 * 2**30, 2**40]
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer, optionally with a suffix .* got '4x'"):
        human_readable_int("4x")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-memory-bytes", "3M"])).kv_cache_memory_bytes == (
        3 * 2**20)


def test_the_summary_gives_the_cache_in_tokens_and_the_requests_of_max_model_len_it_holds():
    grid = types.SimpleNamespace(num_blocks=2053, block_size=16, max_model_len=8192, max_num_batched_tokens=512)
    assert kv_cache_summary(grid, ONE_GROUP).splitlines() == [
        "KV cache size: 32,848 tokens", "Maximum concurrency for 8,192 tokens per request: 4.01x"]


def test_the_summary_counts_a_request_over_every_kv_cache_group():
    """Gemma 3 270M's six groups in 4 GiB of bfloat16 (87,378 blocks of 3 layers): a request of 8,192 tokens holds
    512 blocks in the full group and 34 in each sliding one (window 512 and one token); a step's chunks
    of 2,048 tokens take 129 more of each sliding group once. In one group, 14,563 blocks: 28.44x."""
    layout = layout_for(tuple(layer % 6 != 5 for layer in range(18)), 512)
    grid = types.SimpleNamespace(num_blocks=87_378, block_size=16, max_model_len=8192, max_num_batched_tokens=2048)
    assert kv_cache_summary(grid, layout).splitlines() == [
        "KV cache size: 233,008 tokens", "Maximum concurrency for 8,192 tokens per request: 127.17x"]
    assert f"{(87_378 - 5 * 129) / (512 + 5 * 34):.2f}" == "127.17"
    one_group = types.SimpleNamespace(**{**vars(grid), "num_blocks": 14_563})
    assert kv_cache_summary(one_group, ONE_GROUP).splitlines()[1] == (
        "Maximum concurrency for 8,192 tokens per request: 28.44x")
    check_request_fits(grid, layout)  # one request alone: 512 + 5 * 162 blocks (its first chunk in every group)
    small = types.SimpleNamespace(**{**vars(grid), "num_blocks": 1321})
    with pytest.raises(ValueError, match=r"^max_model_len 8192 needs up to 1322 KV cache blocks of 16 tokens over the "
                       r"model's 6 KV cache groups, and the pool has 1321: raise num_kv_blocks"):
        check_request_fits(small, layout)


def test_the_cli_turns_the_kv_cache_groups_off_as_vllm_does():
    import argparse

    from jaxserve.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config_from_args(parser.parse_args([])).disable_hybrid_kv_cache_manager
    config = engine_config_from_args(parser.parse_args(["--disable-hybrid-kv-cache-manager"]))
    gemma = ModelConfig("Gemma3ForCausalLM", 64, 16, 32, 4, 2, 1, 8, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention") * 2)
    assert config.kv_cache_model_config(gemma, "cpu").kv_cache_layout.windows == (None,)
    assert EngineConfig().kv_cache_model_config(gemma, "cpu").kv_cache_layout.windows == (None, 8)
    with pytest.raises(ValueError, match=r"^disable_hybrid_kv_cache_manager must be True or False, got 1$"):
        EngineConfig(disable_hybrid_kv_cache_manager=1)


def test_the_cpu_pool_default_is_the_same_bytes_with_kv_cache_groups():
    """2048 blocks of every layer: 4 layers in two groups of 2 get 4096 blocks of 2 layers."""
    gemma = ModelConfig("Gemma3ForCausalLM", 64, 16, 32, 4, 2, 1, 8, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention") * 2)
    assert cpu_kv_blocks(gemma) == 4096
    assert cpu_kv_blocks(EngineConfig(disable_hybrid_kv_cache_manager=True).kv_cache_model_config(gemma, "cpu")) == 2048
