"""Many clients at once against a real server: 100 concurrent streams with a third of the clients hanging
up midway, and a non-streaming client that hangs up. Every client that stays gets all its tokens,
every one that leaves is aborted, and afterwards every KV block is free and the server still answers.
Both ways of running the engine: in the server's process, and in an engine core process of its own."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.server import MODEL_NAME, SERVER_BUCKETS, serve

NUM_CLIENTS = 100
KEPT_TOKENS = 8  # tokens each staying client asks for
# tokens each leaving client asks for: it must still run when its abort reaches the engine. An engine core
# process runs ahead of the API process that streams its outputs: 64 tokens were all decoded before a few
# aborts arrived, and 480 too, once, with the test suite's other worker loading both cores (all 34 leaving
# requests ended "length"). 4000 (a model and a context bucket of 4096 positions) leave thousands of steps.
LEFT_TOKENS = 4000
MAX_MODEL_LEN = 4096
LEAVE_AFTER_CHUNKS = 2


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir = make_tiny_model(root / "model", "llama", seed=4, max_position_embeddings=MAX_MODEL_LEN)
    buckets = root / "long_context_buckets.toml"
    buckets.write_text(SERVER_BUCKETS.replace("lengths = [512]", f"lengths = [{MAX_MODEL_LEN}]"))
    server, engine = serve(model_dir, core_process=request.param == "core-process", max_model_len=MAX_MODEL_LEN,
                           buckets=str(buckets))
    with server:
        yield server, engine
    if request.param == "core-process":
        engine.close()


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r"^(jaxserve:[^ ]+) ([0-9.e+-]+)$", text, re.M)}


def _num_requests(engine) -> int:
    scheduler = engine.make_stats().scheduler
    return scheduler.num_running_reqs + scheduler.num_waiting_reqs


def _wait_until_idle(engine, timeout: float = 60.0) -> None:
    """Until the engine (wherever it runs) holds no request and no KV block."""
    deadline = time.monotonic() + timeout
    while _num_requests(engine) or engine.make_stats().scheduler.kv_cache_usage:
        assert time.monotonic() < deadline, "the engine still holds requests"
        time.sleep(0.05)


async def _stream_client(client: httpx.AsyncClient, i: int, leave: bool) -> dict:
    body = {
        "model": MODEL_NAME, "prompt": f"Client number {i} says", "temperature": 0.0, "ignore_eos": True,
        "max_tokens": LEFT_TOKENS if leave else KEPT_TOKENS, "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = {"chunks": 0, "finish_reason": None, "usage": None, "done": False}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"]:
                result["chunks"] += 1
                result["finish_reason"] = chunk["choices"][0]["finish_reason"]
            else:
                result["usage"] = chunk["usage"]
            if leave and result["chunks"] == LEAVE_AFTER_CHUNKS:
                return result  # leaving the block closes the connection mid-stream
    return result


async def _many_clients(base_url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_stream_client(client, i, leave=i % 3 == 0) for i in range(NUM_CLIENTS)))


def test_100_streams_with_a_third_disconnecting(served):
    server, engine = served
    before = _metrics(server.base_url)
    results = asyncio.run(_many_clients(server.base_url))
    _wait_until_idle(engine)
    stayed = [r for i, r in enumerate(results) if i % 3 != 0]
    left = [r for i, r in enumerate(results) if i % 3 == 0]
    assert len(stayed) == 66 and len(left) == 34
    for result in stayed:
        assert result["done"] and result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == KEPT_TOKENS
    assert all(r["chunks"] == LEAVE_AFTER_CHUNKS and not r["done"] for r in left)
    after = _metrics(server.base_url)
    finished = {reason: after[f'jaxserve:request_success_total{{finished_reason="{reason}"}}']
                - before[f'jaxserve:request_success_total{{finished_reason="{reason}"}}']
                for reason in ("length", "abort", "stop")}
    assert finished == {"length": 66, "abort": 34, "stop": 0}
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0
    assert after["jaxserve:num_requests_running"] == after["jaxserve:num_requests_waiting"] == 0
    assert after["jaxserve:compiles_after_warmup_total"] == 0
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_non_streaming_client_that_hangs_up_is_aborted(served):
    server, engine = served
    before = _metrics(server.base_url)
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 500, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not _num_requests(engine):  # hang up once the request runs (500 tokens take far longer)
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.002)
    _wait_until_idle(engine)
    after = _metrics(server.base_url)
    key = 'jaxserve:request_success_total{finished_reason="abort"}'
    assert after[key] - before[key] == 1
    assert after['jaxserve:request_success_total{finished_reason="length"}'] == before[
        'jaxserve:request_success_total{finished_reason="length"}']
    assert engine.make_stats().scheduler.kv_cache_usage == 0.0
    response = httpx.post(server.base_url + "/generate", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and len(response.json()["text"]) == 1
