"""Tensor parallelism on 8 virtual CPU devices. Not collected by the main test run (its name does not
match test_*.py): tests/distributed/test_tensor_parallel.py runs it in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8, since the flag must be set before JAX starts and the
rest of the suite runs on one device."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, BeamSearchParams, SamplingParams
from jaxserve.compilation.compile_cache import num_backend_compiles
from jaxserve.core.sequence import Sequence
from jaxserve.runner.input_batch import StepInputs, step_shape
from jaxserve.runner.sampler import PAD_FLOATS, SamplingRow, SamplingTensors
from jaxserve.testing.hf_reference import hf_greedy
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model, save_tiny_model, tiny_qwen3_next_config

assert jax.device_count() == 8, f"run with XLA_FLAGS=--xla_force_host_platform_device_count=8 ({os.environ})"

PROMPTS = [list(range(3, 40)), [1, 17, 200, 3, 99, 45, 45, 8], [250, 11, 64, 7, 31]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with 8 query heads and 4 kv heads (GQA), so tp 4 splits both."""
    root = tmp_path_factory.mktemp("tp")
    return make_tiny_model(root / "llama", "llama", seed=4, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def buckets(tmp_path_factory):
    # 3 executables: prefill, decode and mixed steps all run under tensor parallelism
    return small_bucket_file(tmp_path_factory.mktemp("buckets"), decode_batch_sizes=(4,), mixed=True)


@pytest.fixture(scope="module")
def llms(model_dir, buckets):
    return {
        tp: LLM(str(model_dir), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=tp)
        for tp in (1, 2, 4)
    }


def _generate(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _prefill_logits(llm, prompt: list[int]) -> np.ndarray:
    """Runs one prefill step of `prompt` on the engine's runner, in blocks taken from (and given back to) its block
    manager, so that no block the prefix cache holds is overwritten; returns its f32[V] logits."""
    engine = llm.llm_engine
    bucket = engine.grid.prefill_buckets[0]
    shape = step_shape(bucket, engine.block_size)
    s, q, p = shape.batch_size, shape.num_query_tokens, shape.pages_per_seq
    ids = np.zeros((s, q), np.int32)
    ids[0, : len(prompt)] = prompt
    scratch = Sequence("prefill-logits", prompt)
    engine.block_manager.allocate(scratch, len(prompt))
    tables = np.zeros((s, p), np.int32)
    tables[0, : len(scratch.block_table)] = scratch.block_table
    engine.block_manager.free(scratch)
    sampling = SamplingTensors.from_rows([SamplingRow(PAD_FLOATS)], s, engine.step_runner.slots.no_slot,
                                         engine.model_config.vocab_size)
    inputs = StepInputs(ids, tables, np.zeros(s, np.int32), np.asarray([len(prompt)] * s, np.int32),
                        np.asarray([len(prompt) - 1] * s, np.int32), sampling)
    return np.asarray(engine.runner.execute(bucket, inputs).logits[0])


def test_greedy_tokens_are_identical_for_tp_1_2_4(llms):
    tokens = {tp: _generate(llm) for tp, llm in llms.items()}
    assert tokens[2] == tokens[1] and tokens[4] == tokens[1]
    assert [len(t) for t in tokens[1]] == [16, 16, 16]
    assert all(llm.llm_engine.stats.num_mixed_steps > 0 for llm in llms.values())


def test_generation_features_are_identical_for_tp_1_2_4(llms):
    """n > 1 forks (copy_blocks), logit_bias (write_slot), penalties and beams on the mesh as on one device."""
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=2,
                             presence_penalty=0.5, logit_bias={5: 3.0})
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    results = {}
    for tp, llm in llms.items():
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[2]}], sampled, use_tqdm=False)[0].outputs
        best = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], beams)[0].sequences
        results[tp] = ([o.token_ids for o in outputs], [b.tokens for b in best])
    assert results[2] == results[1] and results[4] == results[1]
    assert len(results[1][0]) == 2 and len(results[1][1]) == 2


def test_prefix_cache_hits_are_identical_for_tp_1_2_4(llms):
    """A prompt that starts on cached blocks (and a penalized one, whose sampler slot gets the cached tokens'
    counts) generates on the mesh what it generates on one device."""
    prompt = PROMPTS[0] + [7, 8, 9]
    penalized = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5)
    results = {}
    for tp, llm in llms.items():
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)  # PROMPTS[0]'s blocks cached
        outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, [GREEDY, penalized], use_tqdm=False)
        results[tp] = [(o.num_cached_tokens, o.outputs[0].token_ids) for o in outputs]
    block_size = llms[1].llm_engine.block_size
    # PROMPTS[0]'s full blocks, never the block of the prompt's last token
    expected = min(len(PROMPTS[0]), len(prompt) - 1) // block_size * block_size
    assert expected > 0 and [cached for cached, _ in results[1]] == [expected] * 2
    assert results[2] == results[1] and results[4] == results[1]


def test_logits_agree_within_tolerance(llms):
    logits = {tp: _prefill_logits(llm, PROMPTS[1]) for tp, llm in llms.items()}
    assert np.abs(logits[1]).max() > 1.0
    np.testing.assert_allclose(logits[2], logits[1], atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits[4], logits[1], atol=2e-5, rtol=0)


def test_kv_pool_per_device_bytes_shrink_by_the_mesh_size(llms):
    full = llms[1].llm_engine.runner.kv_pool[0]
    for tp, llm in llms.items():
        runner = llm.llm_engine.runner
        for pool in runner.kv_pool:
            assert pool.shape == full.shape
            assert pool.sharding.spec == P(None, "tp") and len(pool.sharding.device_set) == tp
            shards = pool.addressable_shards
            assert len(shards) == tp
            assert {s.data.nbytes for s in shards} == {full.nbytes // tp}
            assert {s.data.shape[1] for s in shards} == {4 // tp}  # kv heads per device


def test_weights_are_split_column_and_row_parallel(llms):
    layers = llms[4].llm_engine.runner.params["params"]["layers"]
    expected = {  # per-device shards of the stacked [L, in, out] kernels: hidden 64, 8 + 4 heads of 8, MLP 128
        ("self_attn", "q_proj"): (2, 64, 16), ("self_attn", "k_proj"): (2, 64, 8),
        ("self_attn", "o_proj"): (2, 16, 64), ("mlp", "gate_proj"): (2, 64, 32),
        ("mlp", "up_proj"): (2, 64, 32), ("mlp", "down_proj"): (2, 32, 64),
    }
    for (block, proj), shard_shape in expected.items():
        kernel = layers[block][proj]["kernel"]
        assert {s.data.shape for s in kernel.addressable_shards} == {shard_shape}, (block, proj)
    embedding = llms[4].llm_engine.runner.params["params"]["embed_tokens"]["embedding"]
    assert embedding.sharding.is_fully_replicated


def test_serving_uses_the_warm_up_shardings_and_compiles_nothing(llms):
    llm = llms[4]
    runner = llm.llm_engine.runner
    before = num_backend_compiles()
    _generate(llm)
    assert num_backend_compiles() == before
    for executable in runner.executables.values():
        params_in, pool_in = executable.input_shardings[0][:2]
        assert pool_in == (runner.kv_pool[0].sharding, runner.kv_pool[1].sharding)
        assert jax.tree.leaves(params_in) == jax.tree.leaves(jax.tree.map(lambda x: x.sharding, runner.params))
        assert executable.output_shardings[1][0].spec == P(None, "tp")  # (logits, pool, slots, positions)


def test_compiled_steps_only_all_reduce_the_row_parallel_outputs_and_update_the_pool_in_place(llms):
    """Megatron's communication and nothing more: the scanned layer body all-reduces the o_proj and
    down_proj outputs ([S, Q, hidden], or [1, T, hidden] in a mixed step); no all-gather (the pool and weights
    never move), and the donated pool's, (replicated) sampler state's and prompt positions' per-device bytes are
    aliased to the output. The sampler executables communicate nothing: every device samples the same replicated
    logits."""
    runner = llms[4].llm_engine.runner
    donated_bytes_per_device = sum(pool.addressable_shards[0].data.nbytes for pool in runner.kv_pool)
    donated = jax.tree.leaves((runner.slot_state, runner.prompt_positions))
    donated_bytes_per_device += sum(x.addressable_shards[0].data.nbytes for x in donated)
    for shape, executable in runner.executables.items():
        hlo = executable.as_text()
        collectives = re.findall(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(", hlo)
        activation = f"f32[{','.join(map(str, shape.input_shape))},64]"
        assert [(t.split("{")[0], op) for t, op in collectives] == [(activation, "all-reduce")] * 2, shape
        assert executable.memory_analysis().alias_size_in_bytes == donated_bytes_per_device
    assert runner.sampler_executables
    for shape, executable in runner.sampler_executables.items():
        assert not re.findall(r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(",
                              executable.as_text()), shape


def test_pallas_backend_under_tensor_parallelism_matches_transformers(tmp_path, buckets):
    """The Pallas kernels (interpret mode on CPU) run per device inside the head shard_map."""
    path = make_tiny_model(tmp_path / "hd64", "llama", seed=3, hidden_size=256, num_attention_heads=4,
                           num_key_value_heads=2)  # head_dim 64, a layout the kernels support
    llm = LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=2,
              attention_backend="pallas")
    assert llm.llm_engine.runner.backend.name == "pallas"
    assert _generate(llm) == [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]


def test_gguf_blocks_and_an_int8_kv_cache_under_tensor_parallelism_match_transformers(tmp_path, buckets):
    """quantization="gguf": the row-parallel layers split their group scales and offsets with their inputs;
    kv_cache_dtype="int8": each device holds its kv heads' pages and their scales, written and read in the head
    shard_map (one engine for both: transformers reads the file with a cache quantizing K/V as the pool does)."""
    import gguf
    import torch
    import transformers

    from jaxserve.testing.hf_reference import greedy_continuation
    from jaxserve.testing.rounding_caches import Int8RoundingCache
    from jaxserve.testing.tiny_gguf import make_tiny_gguf

    kinds = gguf.GGMLQuantizationType
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", seed=5, num_attention_heads=8, num_key_value_heads=4)
    stored = {"attn_q": kinds.Q8_0, "attn_k": kinds.Q4_0, "attn_v": kinds.Q4_1, "attn_output": kinds.Q4_1,
              "ffn_gate": kinds.Q5_1, "ffn_up": kinds.Q5_0, "ffn_down": kinds.Q4_0}  # every layer kept exactly
    path = make_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, stored)
    llm = LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=2,
              quantization="gguf", kv_cache_dtype="int8")
    down = llm.llm_engine.runner.params["params"]["layers"]["mlp"]["down_proj"]
    assert {leaf: value.sharding.spec for leaf, value in down.items()} == {
        leaf: P(None, "tp", None) for leaf in ("kernel", "group_scale", "group_offset")}
    k_pool = llm.llm_engine.runner.kv_pool[0]
    assert k_pool.values.sharding.spec == k_pool.scales.sharding.spec == P(None, "tp")
    assert k_pool.scales.addressable_shards[0].data.shape[1] == 2  # 2 of the 4 kv heads' scales per device
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    model = model.eval()
    assert _generate(llm) == [greedy_continuation(model, p, GREEDY.max_tokens, Int8RoundingCache(config=model.config))
                              for p in PROMPTS]


def test_gpt2_under_tensor_parallelism_matches_transformers(tmp_path, buckets):
    """GPT-2's fused c_attn and Conv1D weights split by heads (OPT's layer is the same `LayerNormDecoderLayer`: its
    own tp case cost the suite an engine for no other code)."""
    path = make_tiny_model(tmp_path / "gpt2", "gpt2", seed=6, n_head=8)
    llm = LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=4)
    assert _generate(llm) == [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize(
    ("family", "overrides", "tp_sizes"),
    [("qwen3_moe", {"num_experts": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "mlp_only_layers": [0]},
      (4,)),
     ("gemma3", {"num_attention_heads": 8, "num_key_value_heads": 4}, (4,)),
     ("gpt_oss", {"num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 4}, (2,)),
     ("deepseek_v3", {}, (2,))],
)
def test_moe_and_gemma3_under_tensor_and_expert_parallelism_match_transformers(tmp_path, buckets, family, overrides,
                                                                               tp_sizes):
    """Attention split by heads, a MoE layer's experts split whole across the devices (2 per device: Qwen3-MoE's
    8 over 4, gpt-oss's 4 over 2) beside a dense layer's MLP split by columns (the Qwen3-MoE has a dense first layer:
    mlp_only_layers); Gemma 3's per-layer windows and local rope under the head split; gpt-oss's sinks split
    with their heads and its experts' biases with their experts; DeepSeek-V3's latent pool whole on each device, its
    heads split (q_b_proj, kv_b_proj), its 8 experts 4 per device. tp 1 is transformers itself."""
    path = make_tiny_model(tmp_path / family, family, seed=7, **overrides)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    for tp in tp_sizes:
        llm = LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=tp)
        assert _generate(llm) == expected, tp
        if family == "qwen3_moe":
            layers = llm.llm_engine.runner.params["params"]["layers"]
            experts = layers["1"]["mlp"]["experts"]["gate_proj"]
            assert {shard.data.shape[0] for shard in experts.addressable_shards} == {8 // tp}
            dense_up = layers["0"]["mlp"]["up_proj"]["kernel"]
            assert {shard.data.shape for shard in dense_up.addressable_shards} == {(64, 128 // tp)}


def test_qwen3_next_under_tensor_and_expert_parallelism_matches_transformers(tmp_path, buckets):
    """Qwen3-Next with full-attention layers only: its gated q_proj (each head's query rows, then its gate rows) split
    with the heads, 4 experts 2 per device beside the shared expert, the dense layer's MLP split by columns."""
    path = save_tiny_model(tmp_path / "qwen3_next", tiny_qwen3_next_config("qwen3_next", num_experts=4), seed=7)
    llm = LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=2)
    assert _generate(llm) == [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    q_proj = llm.llm_engine.runner.params["params"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert {shard.data.shape for shard in q_proj.addressable_shards} == {(48, 4 * 2 * 16 // 2)}


def test_orbax_checkpoint_restores_into_the_mesh_sharding(model_dir, llms, tmp_path, buckets):
    from jaxserve.distributed.sharding import make_mesh, param_shardings
    from jaxserve.weights import load_model
    from tests.weights.test_orbax import convert_checkpoint

    assert convert_checkpoint(model_dir, tmp_path / "orbax") == 0
    mesh = make_mesh(4)
    restored = load_model(str(tmp_path / "orbax"), mesh=mesh).params
    expected = param_shardings(restored, mesh)
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, restored)) == jax.tree.leaves(expected)
    q = restored["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 16)}
    llm = LLM(str(tmp_path / "orbax"), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=4)
    assert _generate(llm) == _generate(llms[1])


def test_heads_not_divisible_by_the_mesh_size_are_a_clear_error(model_dir, buckets):
    with pytest.raises(ValueError, match=r"the model's num_heads \(8\) is not divisible by tensor_parallel_size \(3\)"):
        LLM(str(model_dir), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=3)


def test_fewer_kv_heads_than_devices_is_a_clear_error(tmp_path, buckets):
    path = make_tiny_model(tmp_path / "gqa", "llama", num_attention_heads=8, num_key_value_heads=2)
    message = r"the model's num_kv_heads \(2\) is not divisible by tensor_parallel_size \(4\)"
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=4)


def test_more_devices_than_exist_is_a_clear_error(model_dir, buckets):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(16\) exceeds the 8 available cpu devices"):
        LLM(str(model_dir), dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=16)


def test_bfloat16_layout_splits_too(model_dir, buckets):
    """The CPU bfloat16 layout (unrolled layers, uint16 KV storage) under tp 2: the same greedy tokens as tp 1,
    the pool split by kv heads, nothing compiled while serving."""
    bf16 = {tp: LLM(str(model_dir), dtype="bfloat16", buckets=buckets, max_model_len=128, tensor_parallel_size=tp)
            for tp in (1, 2)}
    runner = bf16[2].llm_engine.runner
    assert runner.kv_pool[0].dtype == np.uint16 and runner.kv_pool[0].sharding.spec == P(None, "tp")
    assert "0" in runner.params["params"]["layers"]  # one module per layer
    compiles_before = num_backend_compiles()
    assert _generate(bf16[2]) == _generate(bf16[1])
    assert num_backend_compiles() == compiles_before


def test_prompt_logprobs_agree_with_the_positions_split_over_the_hidden_axis(llms):
    """A step leaves its hidden states sharded on H (`PromptPositions`); the prompt logprobs' program computes on
    the mesh what it computes on one device."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    found = {}
    for tp, llm in llms.items():
        entries = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].prompt_logprobs
        found[tp] = entries[1:]
        hidden = llm.llm_engine.runner.prompt_positions.hidden
        assert hidden.sharding.spec == P(None, "tp")
        assert hidden.addressable_shards[0].data.shape[1] == hidden.shape[1] // tp
    assert len(found[1]) == len(PROMPTS[0]) - 1
    for tp in (2, 4):
        assert [list(e) for e in found[tp]] == [list(e) for e in found[1]]  # same tokens, same order
        assert [[x.rank for x in e.values()] for e in found[tp]] == [[x.rank for x in e.values()] for e in found[1]]
        np.testing.assert_allclose([[x.logprob for x in e.values()] for e in found[tp]],
                                   [[x.logprob for x in e.values()] for e in found[1]], atol=2e-5)
