"""The continuous-batching engine on a tiny random model: batching changes no token, arrivals join at the
next iteration, preemption loses nothing, every block comes back, and nothing compiles after warm-up."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.compilation.compile_cache import num_backend_compiles
from jaxserve.compilation.sizing import kv_bytes_per_block
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.engine_builder import resolve_async_scheduling
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import VOCAB, make_tiny_model
from tests.paths import SHARED_WORKLOADS

WORKLOAD = SHARED_WORKLOADS / "mixed_lengths.jsonl"
MAX_OUTPUT = 40  # output lengths of the workload are capped so that 32 requests run alone in seconds


def workload_subset(num_requests: int, max_output: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids of exactly prompt_len, output_len) for the first requests of the shared trace."""
    lines = WORKLOAD.read_text().splitlines()[:num_requests]
    rng = np.random.default_rng(seed)
    requests = []
    for line in lines:
        item = json.loads(line)
        prompt = rng.integers(3, vocab, size=item["prompt_len"]).tolist()
        requests.append((prompt, min(item["output_len"], max_output)))
    return requests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=1)


# The CPU grid's shape with fewer sizes (7 executables instead of its 15 up to 16 sequences): decode batches that
# pad, chunked prefill, and mixed steps.
GRID = """
block_size = 16
[decode]
batch_sizes = [1, 4, 16]
[prefill]
batch_sizes = [1]
lengths = [32, 128]
[context]
lengths = [1024]
[mixed]
batch_sizes = [16]
token_counts = [32, 128]
token_budget = 128
"""


@pytest.fixture(scope="module")
def llm(model_dir):
    """Up to 16 sequences: the workload's 32 requests run in turns, admitted as others finish."""
    buckets = model_dir.parent / "grid.toml"
    buckets.write_text(GRID)
    return LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=16, buckets=str(buckets))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate_alone(llm, requests) -> list[list[int]]:
    return [
        llm.generate([{"prompt_token_ids": p}], _greedy(n), use_tqdm=False)[0].outputs[0].token_ids
        for p, n in requests
    ]


def test_continuous_batching_changes_no_token(llm):
    requests = workload_subset(32, MAX_OUTPUT, VOCAB)
    alone = _generate_alone(llm, requests)
    compiles_before = num_backend_compiles()
    batched = llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], [_greedy(n) for _, n in requests], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert [len(t) for t in alone] == [n for _, n in requests]
    stats = llm.llm_engine.stats
    assert stats.num_decode_steps > 0 and stats.num_prefill_steps > 0
    assert num_backend_compiles() == compiles_before  # a mixed workload compiled nothing
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_async_scheduling_is_off_on_cpu_unless_asked_and_on_for_accelerators(llm):
    assert llm.llm_engine.config.async_scheduling is None and llm.llm_engine.async_scheduling is False
    assert [resolve_async_scheduling(None, platform) for platform in ("cpu", "tpu", "gpu")] == [False, True, True]
    assert resolve_async_scheduling(True, "cpu") is True and resolve_async_scheduling(False, "tpu") is False
    with pytest.raises(ValueError, match=r"^async_scheduling must be True, False or None \(auto\), got 'yes'$"):
        EngineConfig(async_scheduling="yes")


def test_async_scheduling_equals_sync_with_early_stops_and_aborts(llm, monkeypatch):
    """Step N+1 is scheduled before step N's tokens are read: sequences that stop on a token the host
    had not seen yet drop the extra row, aborts in flight lose nothing, and every block comes back."""
    engine = llm.llm_engine
    requests = workload_subset(12, 24, VOCAB, seed=3)
    monkeypatch.setattr(engine, "async_scheduling", False)  # the engine's own mode comes back after the test
    free_run = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests], [_greedy(n) for _, n in requests], use_tqdm=False
    )]
    stops = [tokens[len(tokens) // 2] for tokens in free_run]  # each request stops half-way
    params = [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[t], ignore_eos=True)
              for (_, n), t in zip(requests, stops, strict=True)]
    runs = {}
    for mode in (False, True):
        engine.async_scheduling = mode
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                      for o in outputs]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    expected = [(t[: t.index(s) + 1], "stop", s) for t, s in zip(free_run, stops, strict=True)]
    assert runs[True] == runs[False] == expected
    # an abort while the request's next token is still on the device
    engine.add_request("in-flight", {"prompt_token_ids": [5, 6, 7]}, _greedy(30))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort_request("in-flight")
    assert aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == free_run_prefix(llm, [5, 6, 7], 3)  # the 4th was still in flight
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def free_run_prefix(llm, prompt: list[int], num_tokens: int) -> list[int]:
    tokens = llm.generate([{"prompt_token_ids": prompt}], _greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    return tokens[:num_tokens]


def test_request_arriving_while_others_decode_joins_next_iteration(llm):
    engine = llm.llm_engine
    engine.add_request("early", {"prompt_token_ids": [5, 6, 7, 8]}, _greedy(20))
    for _ in range(4):
        engine.step()
    assert engine.requests["early"].seq.num_output_tokens == 4
    engine.add_request("late", {"prompt_token_ids": [9, 10, 11]}, _greedy(5))
    mixed_before = engine.stats.num_mixed_steps
    engine.step()  # the next iteration prefills the newcomer, and the running request decodes in it (mixed)
    assert engine.requests["late"].seq.num_output_tokens == 1
    assert engine.requests["early"].seq.num_output_tokens == 5
    assert engine.stats.num_mixed_steps == mixed_before + 1
    engine.step()  # and then both decode together
    assert engine.requests["late"].seq.num_output_tokens == 2
    assert engine.requests["early"].seq.num_output_tokens == 6
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_a_tiny_pool_keeps_every_token(model_dir, llm, tmp_path, caplog):
    """The pool sized by vLLM's kv_cache_memory_bytes: 12 blocks and a few bytes, so 12 blocks."""
    requests = [(list(range(10 + i, 40 + i)), 50) for i in range(6)]  # 80 tokens each: 5 blocks of 16
    expected = _generate_alone(llm, requests)
    cfg = llm.llm_engine.model_config
    block_bytes = kv_bytes_per_block(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, block_size=16,
                                     head_dim=cfg.head_dim, dtype_bytes=4)
    # only the buckets these requests select (2 executables)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine_builder"):
        small = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=12 * block_bytes + 100,
                    buckets=small_bucket_file(tmp_path, decode_batch_sizes=(1, 2, 4, 8)))
    assert small.llm_engine.block_manager.num_blocks == 12
    assert "Maximum concurrency for 128 tokens per request: 1.50x" in caplog.messages
    outputs = small.generate([{"prompt_token_ids": p} for p, _ in requests], _greedy(50), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.llm_engine.stats.num_preemptions > 0
    assert small.llm_engine.block_manager.num_free_blocks == 12


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 60))}, _greedy(30))
    engine.add_request("b", {"prompt_token_ids": list(range(3, 20))}, _greedy(30))
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_the_same_alone_and_batched(llm):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(5)]
    prompts = [{"prompt_token_ids": [20 + i, 21, 22, 23]} for i in range(5)]
    batched = llm.generate(prompts[:2] + [{"prompt_token_ids": [7, 8, 9]}] + prompts[2:],
                           others[:2] + [params] + others[2:], use_tqdm=False)
    assert batched[2].outputs[0].token_ids == alone
    assert len(set(tuple(o.outputs[0].token_ids) for o in batched)) == 6  # seeds differ, samples differ


def test_top_k_one_equals_greedy(llm):
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    greedy = llm.generate(prompt, _greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=1.5, top_k=1, seed=7, max_tokens=10, ignore_eos=True)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == greedy


def test_too_long_request_is_rejected_with_the_limits(llm):
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens"):
        llm.generate([{"prompt_token_ids": [5] * 1000}], _greedy(100), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_token_and_eos(llm):
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    free = llm.generate(prompt, _greedy(10), use_tqdm=False)[0].outputs[0]
    stop_at = free.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
