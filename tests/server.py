"""A real uvicorn server on 127.0.0.1 and a free port, in a background thread, for the HTTP tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn

from jaxserve import AsyncLLMEngine
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine_core.core_client import AsyncMPEngine, ServerEngine
from jaxserve.entrypoints.api_server import build_app
from jaxserve.entrypoints.launcher import ENGINE_DEAD_GRACE_S, ApiServer

MODEL_NAME = "tiny-llama"
# 5 step executables: decode batches 1, 4 and 16, prefill chunks of 32 and 128, context 512 (the tiny
# models' max_position_embeddings): the server tests warm up in seconds
SERVER_BUCKETS = """
block_size = 16
[decode]
batch_sizes = [1, 4, 16]
[prefill]
batch_sizes = [1]
lengths = [32, 128]
[context]
lengths = [512]
"""



def tiny_engine_config(model_dir, **config) -> EngineConfig:
    buckets = Path(model_dir).parent / "server_buckets.toml"
    buckets.write_text(SERVER_BUCKETS)
    config = {"dtype": "float32", "max_model_len": 512, "buckets": str(buckets), **config}
    return EngineConfig(model=str(model_dir), **config)


def tiny_async_engine(model_dir, **config) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(tiny_engine_config(model_dir, **config)))


def tiny_server_engine(model_dir, core_process: bool, **config) -> ServerEngine:
    """The server's engine in this process, or in an engine core process of its own."""
    if core_process:
        return AsyncMPEngine.launch(tiny_engine_config(model_dir, **config))
    return tiny_async_engine(model_dir, **config)


class ServerThread:
    """`with ServerThread(app, engine) as server:` serves `app` at `server.base_url` until the block ends, or until
    the engine dies (and `engine_dead_grace_s` has passed), as `jaxserve serve` does."""

    def __init__(self, app, engine: ServerEngine, engine_dead_grace_s: float = ENGINE_DEAD_GRACE_S):
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = ApiServer(config, engine, MODEL_NAME, engine_dead_grace_s, announce=False)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(model_dir, api_key: str | None = None, core_process: bool = False,
          engine_dead_grace_s: float = ENGINE_DEAD_GRACE_S, **config) -> tuple[ServerThread, ServerEngine]:
    engine = tiny_server_engine(model_dir, core_process, **config)
    app = build_app(engine, served_model_name=MODEL_NAME, api_key=api_key, model_path=str(model_dir))
    return ServerThread(app, engine, engine_dead_grace_s), engine
