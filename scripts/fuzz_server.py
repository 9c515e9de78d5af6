"""Fuzzes the HTTP server with schemathesis: requests generated from the server's own OpenAPI schema, against a real
server (`python -m jaxserve.entrypoints.api_server`, in-process engine or `--engine-core-process`), checking that
none is answered with a 5xx; then the server must still be healthy (/health 200) and answer a normal completion.

Kept fast by serving the tiny random llama of `jaxserve.testing.tiny_models` (byte-level tokenizer, 320 tokens) on a
small bucket grid with a small `--max-model-len` (default 64): no request can ask for more than that many tokens.

    python scripts/fuzz_server.py                        # in-process engine, 300 examples per operation
    python scripts/fuzz_server.py --engine-core-process --max-examples 300

Exit status 0 when schemathesis found no server error and the server is healthy after; the failing requests are
in schemathesis' output (reproducible with `--seed`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import schemathesis

from jaxserve.testing.ports import free_port
from jaxserve.testing.small_buckets import small_bucket_file
from jaxserve.testing.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600
SERVED_MODEL_NAME = "fuzz"


@schemathesis.hook
def map_body(_context, body):
    """schemathesis hook (this module is its SCHEMATHESIS_HOOKS): a generated body names the served model, so that
    requests get past the model check to everything behind it."""
    if isinstance(body, dict) and "model" in body:
        body["model"] = SERVED_MODEL_NAME
    return body


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-core-process", action="store_true", help="serve with the engine in its own process")
    parser.add_argument("--max-examples", type=int, default=300, help="examples per API operation (default 300)")
    parser.add_argument("--max-model-len", type=int, default=64, help="the server's context length (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="schemathesis' random seed (default 0)")
    parser.add_argument("--workers", type=int, default=2, help="schemathesis' concurrent workers (default 2)")
    return parser.parse_args(argv)


def start_server(workdir: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    model = make_tiny_model(workdir / "model", "llama", seed=0)
    buckets = small_bucket_file(workdir, (1, 4, 16), chunk=32, context=args.max_model_len)
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", SERVED_MODEL_NAME, "--dtype", "float32", "--buckets", buckets,
           "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning"]
    if args.engine_core_process:
        cmd.append("--engine-core-process")
    return subprocess.Popen(cmd, cwd=REPO_ROOT)


def wait_until_healthy(base_url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} while starting")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {START_TIMEOUT_S} s")


def run_schemathesis(base_url: str, workdir: Path, args: argparse.Namespace) -> int:
    """The schemathesis CLI, run in `workdir` (its .schemathesis/ cache stays out of the repository)."""
    schemathesis = Path(sys.executable).with_name("schemathesis")
    cmd = [str(schemathesis), "run", base_url + "/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", str(args.max_examples), "--seed", str(args.seed), "--workers", str(args.workers),
           "--request-timeout", "120", "--continue-on-failure", "--suppress-health-check", "all"]
    print(" ".join(cmd), flush=True)
    env = {**os.environ, "SCHEMATHESIS_HOOKS": Path(__file__).stem,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, check=False, env=env, cwd=workdir).returncode


def still_serves(base_url: str) -> bool:
    """/health is 200 and a normal completion is answered after the fuzzing."""
    health = httpx.get(base_url + "/health", timeout=30).status_code
    completion = httpx.post(base_url + "/v1/completions", timeout=120,
                            json={"model": SERVED_MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
    print(f"after fuzzing: /health {health}, completion {completion.status_code}: {completion.text[:200]}", flush=True)
    return health == 200 and completion.status_code == 200 and len(completion.json()["choices"]) == 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="jaxserve-fuzz-") as workdir:
        server = start_server(Path(workdir), port, args)
        try:
            wait_until_healthy(base_url, server)
            status = run_schemathesis(base_url, Path(workdir), args)
            healthy = still_serves(base_url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"schemathesis exit status {status}; healthy after: {healthy}")
    return 0 if status == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
