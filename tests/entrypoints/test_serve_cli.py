"""`jaxserve serve` and `python -m jaxserve.entrypoints.api_server`: flags map one to one onto EngineConfig,
and the server process announces its address and a curl example once warm, then serves."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.entrypoints import api_server, cli, launcher
from jaxserve.entrypoints.args import ENGINE_CORE_PROCESS, ENGINE_FLAGS, SERVER_MAX_ITL_MS, engine_config_from_args
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from tests.paths import REPO_ROOT


def test_every_engine_config_field_has_its_flag():
    assert set(ENGINE_FLAGS) | {"model"} == {f.name for f in dataclasses.fields(EngineConfig)}


def test_serve_flags_become_the_engine_config(monkeypatch):
    seen = {}

    def fake_run_server(args) -> int:
        seen["args"] = args
        return 0

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    argv = ["serve", "some/model", "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--block-size", "32", "--num-kv-blocks", "64",
            "--gpu-memory-utilization", "0.5", "--buckets", "gpu", "--seed", "3", "--attention-backend", "pallas",
            "--waiting-served-ratio", "1.5", "--scheduling-policy", "priority", "--max-logprobs", "5",
            "--compile-cache-dir", "/tmp/cc",
            "--no-async-scheduling", "-tp", "2", "--distributed-init", "--coordinator-address", "h:1",
            "--num-processes", "2", "--process-id", "1", "--strict-no-compile", "--max-itl-ms", "250",
            "--no-background-compile", "--host", "127.0.0.1", "--port", "9000", "--api-key", "k"]
    assert cli.main(argv) == 0
    args = seen["args"]
    assert engine_config_from_args(args) == EngineConfig(
        model="some/model", dtype="bfloat16", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
        block_size=32, num_kv_blocks=64, gpu_memory_utilization=0.5, buckets="gpu", seed=3,
        attention_backend="pallas", waiting_served_ratio=1.5, scheduling_policy="priority", max_logprobs=5,
        compile_cache_dir="/tmp/cc",
        async_scheduling=False, tensor_parallel_size=2, distributed_init=True, coordinator_address="h:1",
        num_processes=2, process_id=1, strict_no_compile=True, max_itl_ms=250.0,
    )
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 9000, "k")
    defaults = cli.build_parser().parse_args(["serve"])
    # no MODEL: the embedded SmolLM2; a server has a latency target and answers before its whole grid is built
    assert engine_config_from_args(defaults) == EngineConfig(max_itl_ms=SERVER_MAX_ITL_MS, background_compile=True)
    assert (defaults.host, defaults.port) == ("0.0.0.0", 8000)  # vLLM's defaults


def test_max_itl_ms_none_serves_without_a_target_and_offline_runs_have_none(capsys):
    parse = cli.build_parser().parse_args
    assert engine_config_from_args(parse(["serve", "--max-itl-ms", "none"])).max_itl_ms is None
    assert engine_config_from_args(parse(["generate", "hi"])).max_itl_ms is None
    assert engine_config_from_args(parse(["precompile"])).max_itl_ms == SERVER_MAX_ITL_MS  # caches are for servers
    with pytest.raises(SystemExit):
        parse(["serve", "--max-itl-ms", "fast"])
    assert "expected milliseconds or 'none', got 'fast'" in capsys.readouterr().err


def test_engine_core_process_flag():
    parse = cli.build_parser().parse_args
    assert parse(["serve"]).engine_core_process is ENGINE_CORE_PROCESS
    assert parse(["serve", "--engine-core-process"]).engine_core_process is True
    assert parse(["serve", "--no-engine-core-process"]).engine_core_process is False


def test_chat_template_flag_reads_a_file_or_takes_the_template_itself(tmp_path):
    from jaxserve.engine.chat_template import load_chat_template

    template_file = tmp_path / "chatml.jinja"
    template_file.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    args = cli.build_parser().parse_args(["serve", "--chat-template", str(template_file)])
    assert load_chat_template(args.chat_template) == template_file.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"  # escapes
    assert load_chat_template(None) is None
    assert cli.build_parser().parse_args(["serve"]).chat_template is None


def test_an_unreadable_chat_template_path_fails_before_the_model_loads(monkeypatch, tmp_path):
    def load_model(config):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(api_server, "LLMEngine", load_model)
    missing = tmp_path / "missing.jinja"
    args = cli.build_parser().parse_args(["serve", "--chat-template", str(missing)])
    message = f"the chat template '{missing}' looks like a file path, but it could not be read (No such file"
    with pytest.raises(ValueError, match=re.escape(message)):
        api_server.run_server(args)


def test_startup_message_has_the_address_and_a_curl_example():
    message = launcher.startup_message("0.0.0.0", 8123, "m")
    assert "http://localhost:8123" in message
    assert "curl http://localhost:8123/v1/chat/completions" in message and '"model": "m"' in message


@pytest.fixture(scope="module")
def server_model(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model, the compile cache its servers share: the first start compiles, the others load)."""
    root = tmp_path_factory.mktemp("server")
    return make_tiny_model(root / "tiny", "llama", seed=5), root / "xla-cache"


@pytest.fixture(params=["in-process", "core-process"])
def server_process(request, tmp_path, server_model):
    model_dir, cache_dir = server_model
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(1,), context=512)  # two executables
    command = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--model", str(model_dir), "--dtype", "float32",
               "--host", "127.0.0.1", "--port", "0", "--max-model-len", "512", "--buckets", buckets,
               "--api-key", "secret", "--compile-cache-dir", str(cache_dir), "--served-model-name", "tiny",
               "--uvicorn-log-level", "warning",
               "--engine-core-process" if request.param == "core-process" else "--no-engine-core-process"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAXSERVE_LOGGING_LEVEL": "WARNING"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield process, cache_dir
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _read_announcement(process: subprocess.Popen, timeout: float = 240.0) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError("the server exited:\n" + "".join(lines))
        lines.append(line)
        if "curl http://" in line:
            return lines
    raise AssertionError("no announcement:\n" + "".join(lines))


def test_api_server_module_announces_then_serves(server_process):
    process, cache_dir = server_process
    lines = _read_announcement(process)
    ready = next(line for line in lines if line.startswith("jaxserve is ready at "))
    base_url = re.search(r"http://127\.0\.0\.1:\d+", ready).group(0)
    assert httpx.get(base_url + "/health").status_code == 200
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 401
    response = httpx.post(base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert any(cache_dir.iterdir())  # the buckets' executables went to the persistent cache
    cores = _spawned_children(process.pid)
    assert len(cores) == (1 if "--engine-core-process" in process.args else 0)
    process.send_signal(signal.SIGINT)  # Ctrl-C stops the server and its engine core
    # uvicorn re-raises the signal once it has shut down: the process dies of it, or exits 0 where it inherited
    # SIGINT ignored (as under pytest-xdist's workers)
    assert process.wait(timeout=60) in (-signal.SIGINT, 0)
    assert not any(Path(f"/proc/{pid}").exists() for pid in cores)


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (its resource tracker aside)."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("server_process", ["core-process"], indirect=True)
def test_a_crashed_engine_core_turns_health_to_503_then_the_server_exits_1(server_process):
    process, _ = server_process
    lines = _read_announcement(process)
    base_url = re.search(r"http://127\.0\.0\.1:\d+", "".join(lines)).group(0)
    (core,) = _spawned_children(process.pid)
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + launcher.ENGINE_DEAD_GRACE_S
    while (status := httpx.get(base_url + "/health").status_code) == 200:  # until the server notices
        assert time.monotonic() < deadline, "/health still answers 200 with the engine core dead"
        time.sleep(0.01)
    assert status == 503
    assert process.wait(timeout=30) == 1
    assert f"the engine core process (pid {core}) exited with code -9" in process.stdout.read()
