"""Multi-host serving: two processes on 127.0.0.1 (2 CPU devices each) run `jaxserve serve --distributed-init` with
tensor parallel 4 across them. Process 0 serves HTTP and schedules; process 1 makes the same device calls. Through
the openai client, completions streamed and not carry the tokens of one process with four devices (with async
scheduling too); stopping process 0 stops process 1; killing process 1 turns process 0's /health to 503 naming it,
and process 0 exits within the host timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve.distributed.host_links import HEARTBEAT_S, LOST_EXIT_GRACE_S
from jaxserve.testing.ports import free_port
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from tests.distributed.four_device_reference import MAX_TOKENS
from tests.paths import REPO_ROOT

PROMPTS = ["The quick brown fox", "Hello, world", "a"]
HOST_TIMEOUT_S = 5
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("multihost-serving")
    model_dir = make_tiny_model(path / "llama", "llama", seed=4, num_attention_heads=8, num_key_value_heads=4)
    return model_dir, small_bucket_file(path, decode_batch_sizes=(4,))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> list[dict]:
    model_dir, buckets = model
    out = tmp_path_factory.mktemp("reference") / "reference.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    cmd = [sys.executable, "-m", "tests.distributed.four_device_reference", str(model_dir), buckets, str(out), *PROMPTS]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(out.read_text())


class Hosts:
    """Two `python -m jaxserve.entrypoints.api_server` processes, one per "host", each in a session of its own."""

    def __init__(self, model_dir: Path, buckets: str, log_dir: Path, *extra_flags: str):
        coordinator, self.port = free_port(), free_port()
        self.logs = [log_dir / f"host{i}.log" for i in range(2)]
        self.procs = []
        for process_id, log in enumerate(self.logs):
            env = {
                **os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}", "JAXSERVE_NUM_PROCESSES": "2",
                "JAXSERVE_PROCESS_ID": str(process_id), "JAXSERVE_HOST_TIMEOUT_S": str(HOST_TIMEOUT_S),
            }
            cmd = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--model", str(model_dir),
                   "--distributed-init", "--tensor-parallel-size", "4", "--dtype", "float32", "--buckets", buckets,
                   "--max-model-len", "128", "--max-itl-ms", "none", "--host", "127.0.0.1", "--port", str(self.port),
                   "--served-model-name", "tiny", *extra_flags]
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc, log in zip(self.procs, self.logs, strict=True):
                assert proc.poll() is None, log.read_text()[-5000:]
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"host 0 did not serve within {START_TIMEOUT_S}s:\n{self.logs[0].read_text()[-5000:]}")

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _completions(base_url: str) -> tuple[list[str], str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    texts = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=extra).choices[0].text for p in PROMPTS]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body=extra)
    return texts, "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_two_hosts_serve_the_tokens_of_one_process_and_stop_together(model, reference, tmp_path):
    hosts = Hosts(*model, tmp_path)
    try:
        hosts.wait_until_serving()
        texts, streamed = _completions(hosts.base_url)
        assert texts == [r["text"] for r in reference]
        assert streamed == reference[0]["text"]
        assert "host 1 (process 1) follows host 0's steps (no HTTP server here)" in hosts.log(1)
        hosts.procs[0].send_signal(signal.SIGTERM)  # a clean shutdown of host 0: host 1 stops too, status 0
        statuses = [proc.wait(timeout=60) for proc in hosts.procs]
        assert statuses == [-signal.SIGTERM, 0], hosts.log(1)[-3000:]  # uvicorn ends on the signal it handled
        assert "host 0 stopped serving after" in hosts.log(1)
    finally:
        hosts.kill()


def test_a_lost_host_makes_host_0_answer_503_naming_it_then_every_process_exits(model, reference, tmp_path):
    # the engine core split, and async scheduling: each step reads the one before it on the device, so the followers
    # resolve host 0's reference to that step's tokens
    hosts = Hosts(*model, tmp_path, "--engine-core-process", "--async-scheduling")
    try:
        hosts.wait_until_serving()
        texts, _ = _completions(hosts.base_url)
        assert texts == [r["text"] for r in reference]
        os.killpg(hosts.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        reason = None
        while hosts.procs[0].poll() is None and time.monotonic() - killed < 60:
            try:
                health = httpx.get(f"{hosts.base_url}/health", timeout=1)
                if health.status_code == 503:
                    reason = health.text
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        exited_after = time.monotonic() - killed
        assert hosts.procs[0].wait(timeout=5) == 1
        assert exited_after < HOST_TIMEOUT_S + HEARTBEAT_S + LOST_EXIT_GRACE_S + 5
        assert reason is not None and "host 1 (process 1) has not been heard from" in reason
        assert "multi-host serving stopped: host 1 (process 1) has not been heard from for" in hosts.log(0)
    finally:
        hosts.kill()
