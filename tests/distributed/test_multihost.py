"""Multi-host: two processes on 127.0.0.1 (2 CPU devices each, gloo collectives) join with
`jax.distributed.initialize` and run one tensor-parallel engine over all 4 devices; both processes produce
the greedy tokens of a single-device engine, each holding a quarter of the KV pool per device, and an orbax
checkpoint restores across both processes into exactly the shards the engine placed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxserve import LLM, SamplingParams
from jaxserve.testing.ports import free_port
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model
from tests.distributed.multihost_worker import MAX_TOKENS, PROMPTS
from tests.paths import REPO_ROOT
from tests.weights.test_orbax import convert_checkpoint


def _run_workers(model_dir: Path, orbax_dir: Path, buckets: str, out_dir: Path) -> list[dict]:
    port = free_port()
    procs = []
    for process_id in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "JAXSERVE_DISTRIBUTED_INIT": "1",
            "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAXSERVE_NUM_PROCESSES": "2",
            "JAXSERVE_PROCESS_ID": str(process_id),
        }
        out = out_dir / f"process{process_id}.json"
        cmd = [sys.executable, "-m", "tests.distributed.multihost_worker", str(model_dir), str(orbax_dir), buckets,
               str(out)]
        log = open(out_dir / f"process{process_id}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, out))
    results = []
    for proc, log, out in procs:
        try:
            returncode = proc.wait(timeout=600)
        finally:
            proc.kill()
            log.close()
        assert returncode == 0, (out.with_suffix(".log")).read_text()[-5000:]
        results.append(json.loads(out.read_text()))
    return results


def test_two_process_engine_matches_single_device(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", "llama", seed=4, num_attention_heads=8, num_key_value_heads=4)
    buckets = small_bucket_file(tmp_path, decode_batch_sizes=(4,))
    assert convert_checkpoint(model_dir, tmp_path / "orbax") == 0
    results = _run_workers(model_dir, tmp_path / "orbax", buckets, tmp_path)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single = LLM(str(model_dir), dtype="float32", buckets=buckets, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in single.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    assert [r["process_index"] for r in results] == [0, 1]
    for result in results:
        assert (result["process_count"], result["device_count"], result["local_device_count"]) == (2, 4, 2)
        assert result["pool_devices"] == 4
        assert result["pool_local_shard_bytes"] == [result["pool_bytes"] // 4] * 2
        assert result["tokens"] == expected
        assert result["orbax_shards_match"]
