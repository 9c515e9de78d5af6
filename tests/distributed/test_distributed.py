"""Multi-host and tensor-parallel settings: environment fallbacks for jax.distributed.initialize, the CLI
flags reaching EngineConfig, and clear errors for bad values. (The real two-process run is in
test_multihost.py, the 8-device runs in test_tensor_parallel.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import jax
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.distributed.multihost import distributed_init_requested, distributed_settings, join_timeout_s
from jaxserve.distributed.sharding import engine_mesh, param_spec
from jaxserve.entrypoints.args import engine_config_from_args
from jaxserve.entrypoints.cli import build_parser
from jaxserve.testing.ports import free_port
from tests.paths import REPO_ROOT


def test_settings_come_from_arguments_then_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAXSERVE_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXSERVE_PROCESS_ID", "3")
    assert distributed_settings() == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert distributed_settings(process_id=0) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 0,
    }


def test_no_settings_leave_detection_to_jax(monkeypatch):
    for name in ("JAXSERVE_COORDINATOR_ADDRESS", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed_settings() == {}


def test_bad_integer_in_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAXSERVE_NUM_PROCESSES must be an integer, got 'two'"):
        distributed_settings()


def test_initialisation_is_requested_by_flag_or_environment(monkeypatch):
    monkeypatch.delenv("JAXSERVE_DISTRIBUTED_INIT", raising=False)
    assert not distributed_init_requested(False)
    assert distributed_init_requested(True)
    monkeypatch.setenv("JAXSERVE_DISTRIBUTED_INIT", "1")
    assert distributed_init_requested(False)


def test_a_process_whose_peers_never_join_ends_within_the_join_timeout(monkeypatch):
    """JAX ends a process the others never joined (DEADLINE_EXCEEDED) after JAXSERVE_DISTRIBUTED_TIMEOUT_S; the log
    says beforehand what it waits for."""
    code = f"from jaxserve.distributed.multihost import initialize_distributed; " \
           f"initialize_distributed('127.0.0.1:{free_port()}', 2, 0)"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAXSERVE_DISTRIBUTED_TIMEOUT_S": "3"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and time.monotonic() - started < 60
    assert "every process must join within 3 s (JAXSERVE_DISTRIBUTED_TIMEOUT_S)" in done.stdout + done.stderr
    assert "DEADLINE_EXCEEDED" in done.stderr
    monkeypatch.setenv("JAXSERVE_DISTRIBUTED_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="_TIMEOUT_S must be a whole number of seconds, got 'soon'"):
        join_timeout_s()


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "generate", "hi", "--tensor-parallel-size", "4", "--distributed-init",
        "--coordinator-address", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1",
    ])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.distributed_init, config.coordinator_address) == (
        4, True, "10.0.0.1:1234",
    )
    assert (config.num_processes, config.process_id) == (2, 1)
    assert build_parser().parse_args(["generate", "hi", "-tp", "2"]).tensor_parallel_size == 2


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_multi_process_mesh_must_span_every_device(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    with pytest.raises(ValueError, match=r"with 2 processes, tensor_parallel_size \(4\) must equal the global "
                       r"device count \(8\)"):
        engine_mesh(4)


def test_partition_rules():
    layers = ("params", "layers")
    assert param_spec((*layers, "self_attn", "q_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, None, "tp")
    assert param_spec((*layers, "self_attn", "q_proj", "bias"), 2) == jax.sharding.PartitionSpec(None, "tp")
    assert param_spec((*layers, "mlp", "down_proj", "kernel"), 3) == jax.sharding.PartitionSpec(None, "tp", None)
    assert param_spec((*layers, "mlp", "down_proj", "bias"), 2) == jax.sharding.PartitionSpec()
    assert param_spec(("params", "embed_tokens", "embedding"), 2) == jax.sharding.PartitionSpec()
    assert param_spec(("params", "lm_head", "kernel"), 2) == jax.sharding.PartitionSpec()
