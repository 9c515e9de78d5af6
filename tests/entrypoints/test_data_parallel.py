"""`--data-parallel-size 2`: two engine cores on their own devices behind one server (each core process sees two CPU
devices and takes the one of its rank). Concurrent requests spread over the cores and get the single engine's
greedy tokens, stats and KV event sources cover both, a flush reaches both, and a core that dies takes the server's
health with it, naming its replica."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import httpx
import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_events_config import KVEventsConfig
from jaxserve.distributed.sharding import engine_mesh
from jaxserve.engine_core.data_parallel import DataParallelEngine
from jaxserve.entrypoints.api_server import build_app, start_engine
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from tests.server import MODEL_NAME, ServerThread

PROMPTS = [list(range(3, 40)), [1, 17, 200, 3, 99, 45, 45, 8], [250, 11, 64, 7, 31], list(range(60, 90))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=6)


def _config(model_dir, **config) -> EngineConfig:
    """Two executables (decode batch 4, prefill chunks of 32, context 128): each core warms up in seconds."""
    buckets = small_bucket_file(model_dir.parent, decode_batch_sizes=(4,))
    return EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, buckets=buckets, **config)


@pytest.fixture(scope="module")
def server(model_dir):
    """A server over two cores; the core processes inherit two CPU devices each from XLA_FLAGS."""
    flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    try:
        config = _config(model_dir, data_parallel_size=2, kv_events_config={
            "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
        engine = DataParallelEngine.launch(config)
    finally:
        if flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = flags
    app = build_app(engine, served_model_name=MODEL_NAME, model_path=str(model_dir))
    with ServerThread(app, engine, engine_dead_grace_s=60) as thread:  # the last test reads its 503
        yield thread, engine
    engine.close()


def _complete(base_url: str, prompt: list[int]) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_concurrent_requests_spread_over_the_replicas_with_the_single_engines_tokens(server, model_dir):
    thread, engine = server
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(thread.base_url, p), PROMPTS))
    config = _config(model_dir)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=config.max_model_len, buckets=config.buckets)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert texts == [o.outputs[0].text for o in outputs]
    per_core = [core.make_stats().engine.num_prompt_tokens for core in engine.cores]
    assert all(per_core) and sum(per_core) == sum(map(len, PROMPTS))  # both served, every prompt once
    assert engine.make_stats().engine.num_prompt_tokens == sum(map(len, PROMPTS))


def test_kv_event_sources_name_each_replica_and_a_flush_reaches_both(server):
    thread, engine = server
    sources = httpx.get(thread.base_url + "/kv_event_sources").json()
    assert sorted(sources) == ["0", "1"] and sources["0"]["endpoint"] != sources["1"]["endpoint"]
    cached = sum(core.make_stats().scheduler.prefix_cache_queries > 0 for core in engine.cores)
    assert cached == 2 and httpx.post(thread.base_url + "/flush_cache").json()["num_blocks_dropped"] > 0
    assert httpx.post(thread.base_url + "/flush_cache").json() == {"num_blocks_dropped": 0}


def test_the_cores_do_not_reserve_every_accelerator_up_front(server):
    """Each core sees every device of the host: it starts with JAX's preallocation off; the server's own environment
    stays as it was."""
    _, engine = server
    for core in engine.cores:
        environ = Path(f"/proc/{core.process.pid}/environ").read_bytes().split(b"\0")
        assert b"XLA_PYTHON_CLIENT_PREALLOCATE=false" in environ
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ


def test_a_replica_port_is_the_endpoints_plus_its_rank():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    assert (config.for_rank(0).endpoint, config.for_rank(2).endpoint) == ("tcp://*:5557", "tcp://*:5559")
    assert config.for_rank(2).replay_endpoint == "tcp://*:5602"
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:*").for_rank(1).endpoint == "tcp://127.0.0.1:*"
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").for_rank(1).endpoint == "ipc:///tmp/kv"


def test_bad_data_parallel_settings_are_refused():
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer, got 0"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"data_parallel_rank must be in \[0, 2\) \(data_parallel_size\), got 2"):
        EngineConfig(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="an offline LLM runs one engine"):
        LLM(data_parallel_size=2)
    n = len(jax.devices())
    message = rf"data-parallel replica {n} needs devices {n} to {n} \(tensor_parallel_size 1 each\), but this host has"
    with pytest.raises(ValueError, match=message):
        engine_mesh(1, data_parallel_rank=n)
    with pytest.raises(ValueError, match="--data-parallel-size with --distributed-init: a multi-host server runs one"):
        start_engine(EngineConfig(data_parallel_size=2, distributed_init=True), core_process=False)


def test_a_dead_replica_makes_the_server_unhealthy_naming_it(server):
    thread, engine = server
    os.kill(engine.cores[1].process.pid, signal.SIGKILL)
    engine.cores[1].process.join(timeout=30)
    health = httpx.get(thread.base_url + "/health")
    assert health.status_code == 503
    assert health.json()["error"]["message"].startswith("data-parallel replica 1: the engine core process")
