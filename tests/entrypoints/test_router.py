"""Two replicas of the embedded model behind vLLM's router (`vllm-router --policy round_robin`, on loopback): 64 chats
through the openai client all get the greedy answer a replica gives alone, and each replica serves half (their
/metrics). Then 64 more, half of them streamed, with one replica killed after the first few: no request is lost
(the router retries what failed before its headers; a stream the replica had started may break, and those are
counted), the survivor answers the rest, and the router's health check marks the dead replica."""

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

import httpx
import openai
import pytest

from jaxserve.testing.ports import free_port
from tests.paths import REPO_ROOT, SHARED_WORKLOADS

REQUESTS = 64
CLIENT_THREADS = 8
MAX_TOKENS = 12
KILL_AFTER = 8  # answers of the second round before one replica is killed
START_TIMEOUT_S = 600
ROUTER = Path(sys.executable).with_name("vllm-router")


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
def replicas(tmp_path_factory):
    """[(url, process, log)]: started one after the other, so the second loads the first's compiled steps."""
    logs = tmp_path_factory.mktemp("replicas")
    started = []
    try:
        for i in range(2):
            port, log = free_port(), logs / f"replica{i}.log"
            cmd = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--dtype", "float32", "--max-model-len",
                   "1024", "--max-num-seqs", "16", "--max-itl-ms", "none", "--host", "127.0.0.1", "--port", str(port)]
            started.append((f"http://127.0.0.1:{port}", _start(cmd, log), log))
            _wait_until(started[-1][0] + "/health", started[-1][1], log)
        yield started
    finally:
        for _, proc, _ in started:
            _stop(proc)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    """The router's URL: round robin, health checked every second, unhealthy after two failed checks."""
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--worker-urls", *[url for url, _, _ in replicas], "--health-check-interval-secs", "1",
           "--health-failure-threshold", "2", "--worker-startup-check-interval", "1",
           "--prometheus-port", str(free_port())]
    proc = _start(cmd, log)
    try:
        _wait_until(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def model_name(replicas) -> str:
    return httpx.get(replicas[0][0] + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def expected(replicas, model_name) -> list[str]:
    """Each chat's greedy answer from the first replica alone (CLIENT_THREADS at a time)."""
    client = openai.OpenAI(base_url=replicas[0][0] + "/v1", api_key="none", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS) as pool:
        return list(pool.map(lambda chat: _ask(client, model_name, chat, stream=False), _chats()))


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
    before = [_successes(url) for url, _, _ in replicas]
    results = _run(router, model_name, streamed=set())
    assert [results[i] for i in range(REQUESTS)] == [expected[i % len(expected)] for i in range(REQUESTS)]
    served = [_successes(url) - count for (url, _, _), count in zip(replicas, before, strict=True)]
    assert served == [REQUESTS // 2, REQUESTS // 2]  # round robin


def test_a_killed_replica_loses_no_request_and_the_router_marks_it(replicas, router, model_name, expected):
    (survivor, _, _), (victim, victim_proc, _) = replicas
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
