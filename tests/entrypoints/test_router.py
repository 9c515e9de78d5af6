"""Two replicas of the embedded model behind vLLM's router (on loopback). `--policy round_robin`: 64 chats through
the openai client all get transformers' greedy answer (tests/embedded_reference.py, not a replica's own), and each
replica serves half (their /metrics). `--policy kv_aware` (a second router over the same replicas, which publish their
KV cache events): with prefix A cached on the first replica and prefix B on the second, 6 requests sharing A and 2
sharing B, one at a time, go where their prefix is: served 6 / 2 (round robin would split them 4 / 4), every prefix
token a cache hit. Last, with the round-robin router: 64 more chats, half of them streamed, with one replica killed
after the first few: no request is lost (the router retries what failed before its headers; a stream the replica had
started may break, and those are counted), the survivor answers the rest, and the router's health check marks the
dead replica. The tests run in this order (the last kills a replica)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import msgpack
import numpy as np
import openai
import pytest
import zmq

from jaxserve.entrypoints.cli import chat_prompt_ids
from jaxserve.testing.ports import free_port
from jaxserve.weights import embedded_model_path, load_tokenizer
from tests.embedded_reference import hf_greedy_references
from tests.paths import REPO_ROOT, SHARED_WORKLOADS

REQUESTS = 64
CLIENT_THREADS = 8
MAX_TOKENS = 12
KILL_AFTER = 8  # answers of the second round before one replica is killed
START_TIMEOUT_S = 600
ROUTER = Path(sys.executable).with_name("vllm-router")
BLOCK_SIZE = 16  # the replicas' KV block size
PREFIX_BLOCKS = 16  # the kv_aware test's shared prefixes: 256 tokens each, then a suffix of its own per request
KV_AWARE_ORDER = "AABAAABA"  # 6 requests sharing prefix A (cached on the first replica), 2 sharing B (the second)


class Replica(NamedTuple):
    url: str
    proc: subprocess.Popen
    log: Path
    kv_events: str  # where its KV cache events are published (a ZeroMQ PUB socket)


def _chats() -> list[list[dict]]:
    lines = (SHARED_WORKLOADS / "chat_questions.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


def _wait_until(url: str, proc: subprocess.Popen, log: Path, status: int = 200) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-5000:]
        try:
            if httpx.get(url, timeout=2).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer {status} within {START_TIMEOUT_S}s:\n{log.read_text()[-5000:]}")


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[Replica]:
    """Started one after the other, so the second loads the first's compiled steps; each publishes its KV cache events
    on a port of its own (a wildcard endpoint binds, as `kv_aware` needs)."""
    logs = tmp_path_factory.mktemp("replicas")
    started = []
    try:
        for i in range(2):
            port, events, log = free_port(), free_port(), logs / f"replica{i}.log"
            config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}"})
            cmd = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--dtype", "float32", "--max-model-len",
                   "1024", "--max-num-seqs", "16", "--max-itl-ms", "none", "--host", "127.0.0.1", "--port", str(port),
                   "--kv-events-config", config]
            started.append(Replica(f"http://127.0.0.1:{port}", _start(cmd, log), log, f"tcp://127.0.0.1:{events}"))
            _wait_until(started[-1].url + "/health", started[-1].proc, log)
        yield started
    finally:
        for replica in started:
            _stop(replica.proc)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    """The router's URL: round robin, health checked every second, unhealthy after two failed checks."""
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--worker-urls", *[replica.url for replica in replicas], "--health-check-interval-secs", "1",
           "--health-failure-threshold", "2", "--worker-startup-check-interval", "1",
           "--prometheus-port", str(free_port())]
    proc = _start(cmd, log)
    try:
        _wait_until(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def kv_aware_router(replicas, tmp_path_factory):
    """A second router's URL, `--policy kv_aware`, once it has subscribed to both replicas' KV cache events (found
    through their /kv_event_sources; its log names each subscription)."""
    port, log = free_port(), tmp_path_factory.mktemp("kv_aware_router") / "router.log"
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware", "--worker-urls",
           *[replica.url for replica in replicas], "--worker-startup-check-interval", "1",
           "--prometheus-port", str(free_port())]
    proc = _start(cmd, log)
    try:
        _wait_until(f"http://127.0.0.1:{port}/health", proc, log)
        _wait_for_log(log, [f"kv_index subscriber for {replica.url} " for replica in replicas], proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _wait_for_log(log: Path, lines: list[str], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(line in log.read_text() for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def model_name(replicas) -> str:
    return httpx.get(replicas[0].url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def expected(reference_dir) -> list[str]:
    """Each chat's greedy answer (MAX_TOKENS tokens or up to EOS) by transformers on the same model, not by a
    replica: the session's shared reference (tests/embedded_reference.py; its first MAX_TOKENS steps have no
    near tie, the closest margin 3e-3, so float32 rounding cannot change a token)."""
    tokenizer = load_tokenizer(embedded_model_path())
    prompts = [chat_prompt_ids(tokenizer, chat) for chat in _chats()]
    references = hf_greedy_references(prompts, tokenizer.eos_token_id, reference_dir)
    answers = []
    for reference in references:
        tokens = reference.tokens[:MAX_TOKENS]
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return answers


def _ask(client: openai.OpenAI, model: str, messages: list[dict], stream: bool) -> str:
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=stream)
    if not stream:
        return answer.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)


def _successes(url: str) -> int:
    """The replica's finished requests, by its /metrics."""
    text = httpx.get(url + "/metrics").text
    return int(sum(float(v) for v in re.findall(r"^jaxserve:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


def _run(router_url: str, model: str, streamed: set[int], on_answer=None) -> dict[int, str | BaseException]:
    """REQUESTS chats through the router on CLIENT_THREADS threads (request i asks chat i % 32); each answer or
    the error that ended it."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0)  # the router retries
    chats, results = _chats(), {}

    def ask(i: int) -> tuple[int, str | BaseException]:
        try:
            return i, _ask(client, model, chats[i % len(chats)], stream=i in streamed)
        except (openai.APIError, httpx.HTTPError) as err:
            return i, err

    with concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS) as pool:
        for future in concurrent.futures.as_completed([pool.submit(ask, i) for i in range(REQUESTS)]):
            i, answer = future.result()
            results[i] = answer
            if on_answer is not None:
                on_answer(len(results))
    return results


def test_the_router_spreads_64_chats_over_both_replicas(replicas, router, model_name, expected):
    before = [_successes(replica.url) for replica in replicas]
    results = _run(router, model_name, streamed=set())
    assert [results[i] for i in range(REQUESTS)] == [expected[i % len(expected)] for i in range(REQUESTS)]
    served = [_successes(replica.url) - count for replica, count in zip(replicas, before, strict=True)]
    assert served == [REQUESTS // 2, REQUESTS // 2]  # round robin


def _prefix_cache_hits(url: str) -> int:
    """Prompt tokens the replica found in its prefix cache, by its /metrics."""
    text = httpx.get(url + "/metrics").text
    return int(float(re.search(r"^jaxserve:prefix_cache_hits_total (\S+)$", text, re.M).group(1)))


def _complete(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


def _wait_for_stored(subscriber: zmq.Socket, first_token: int) -> None:
    """Until the replica publishes the BlockStored event of a prompt starting with ``first_token`` (the router,
    subscribed to the same socket, gets it at the same time)."""
    while subscriber.poll(START_TIMEOUT_S * 1000):
        _, _, payload = subscriber.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored" and event["token_ids"][0] == first_token:
                return
    raise AssertionError(f"no BlockStored of the prompt starting with {first_token} within {START_TIMEOUT_S}s")


def test_kv_aware_sends_each_prefix_to_the_replica_that_holds_it(replicas, kv_aware_router, model_name):
    rng = np.random.default_rng(56)
    prefixes = {name: rng.integers(1000, 40000, PREFIX_BLOCKS * BLOCK_SIZE).tolist() for name in "AB"}
    httpx.post(kv_aware_router + "/flush_cache", timeout=60).raise_for_status()  # every replica: nothing cached
    context = zmq.Context.instance()
    for replica, name in zip(replicas, "AB", strict=True):  # A on the first replica, B on the second, directly
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(replica.kv_events)
        try:
            _complete(replica.url, model_name, prefixes[name] + [7, 7, 7])
            _wait_for_stored(subscriber, prefixes[name][0])
        finally:
            subscriber.close(linger=0)
    served_before = [_successes(replica.url) for replica in replicas]
    hits_before = [_prefix_cache_hits(replica.url) for replica in replicas]
    for i, name in enumerate(KV_AWARE_ORDER):  # one at a time: no replica is busier, the cached prefix decides
        _complete(kv_aware_router, model_name, prefixes[name] + [100 + i, 200 + i, 300 + i])
    served = [_successes(r.url) - count for r, count in zip(replicas, served_before, strict=True)]
    hits = [_prefix_cache_hits(r.url) - count for r, count in zip(replicas, hits_before, strict=True)]
    per_prefix = [KV_AWARE_ORDER.count(name) for name in "AB"]
    assert served == per_prefix == [6, 2]
    assert hits == [n * PREFIX_BLOCKS * BLOCK_SIZE for n in per_prefix]  # every prefix token found cached


def test_a_killed_replica_loses_no_request_and_the_router_marks_it(replicas, router, model_name, expected):
    (survivor, _, _, _), (victim, victim_proc, _, _) = replicas
    before = _successes(survivor)
    streamed = set(range(1, REQUESTS, 2))

    def kill_victim(num_answered: int) -> None:
        if num_answered == KILL_AFTER:
            _stop(victim_proc)

    results = _run(router, model_name, streamed, on_answer=kill_victim)
    broken = {i: err for i, err in results.items() if isinstance(err, BaseException)}
    print(f"\nstreams broken by the kill: {len(broken)} of {len(streamed)} streamed ({sorted(broken)})")
    assert set(broken) <= streamed, broken  # a request that had not streamed anything is retried, never lost
    assert len(broken) < CLIENT_THREADS  # at most those in flight on the victim when it died
    for i, answer in results.items():
        if i not in broken:
            assert answer == expected[i % len(expected)], i
    assert _successes(survivor) - before >= REQUESTS - KILL_AFTER - CLIENT_THREADS
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = {w["url"]: w["is_healthy"] for w in httpx.get(router + "/workers").json()["workers"]}
        if workers == {survivor: True, victim: False}:
            break
        time.sleep(0.5)
    assert workers == {survivor: True, victim: False}
    health = httpx.get(router + "/health")
    assert health.status_code == 503 and victim in health.text
