"""Runs the HTTP app under uvicorn: announces the address once the socket listens, and stops the server when its
engine dies (vLLM's launcher does the same), so a supervisor restarts it instead of finding it hung.

Place in the data flow: `api_server.run_server` builds the app over a warm engine and hands it here; this module
owns the uvicorn server's life. A dead engine (its core process exited, or the in-process step loop ended on a
bug) turns `/health` to 503 and every request to a 503 naming the reason; the server sees it at uvicorn's next
tick (0.1 s), keeps answering so for `ENGINE_DEAD_GRACE_S` (health checkers and clients learn why), then shuts
down gracefully and the process exits with status 1.
"""

from __future__ import annotations

import json
import time

import uvicorn

from jaxserve.engine_core.core_client import ServerEngine
from jaxserve.logger import init_logger

logger = init_logger("jaxserve.launcher")

ENGINE_DEAD_GRACE_S = 1.0  # how long a server whose engine died still answers (503) before it exits


class ApiServer(uvicorn.Server):
    """uvicorn over jaxserve's app: prints the address and a curl example once the socket listens (the engine is
    warm by then), and exits when the engine dies (`engine_died` tells the caller)."""

    def __init__(self, config: uvicorn.Config, engine: ServerEngine, served_model_name: str,
                 engine_dead_grace_s: float = ENGINE_DEAD_GRACE_S, announce: bool = True):
        super().__init__(config)
        self.engine = engine
        self.served_model_name = served_model_name
        self.engine_dead_grace_s = engine_dead_grace_s
        self.announce = announce
        self.engine_died = False
        self._dead_since: float | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announce:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(startup_message(host, port, self.served_model_name), flush=True)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop asks every 0.1 s whether to stop: also once the engine has been dead for the grace."""
        should_exit = await super().on_tick(counter)
        reason = self.engine.dead_reason
        if reason is None:
            return should_exit
        if self._dead_since is None:
            self._dead_since, self.engine_died = time.monotonic(), True
            logger.error("%s: the server answers 503 for %.1fs, then exits", reason, self.engine_dead_grace_s)
        return should_exit or time.monotonic() - self._dead_since >= self.engine_dead_grace_s


def startup_message(host: str, port: int, served_model_name: str) -> str:
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    body = json.dumps({"model": served_model_name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return (
        f"jaxserve is ready at http://{shown}:{port} (OpenAI API under /v1, /generate, /metrics). Try:\n"
        f"  curl http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    )
