"""DataParallelEngine: `--data-parallel-size N` engine cores on one host behind one API server (vLLM's internal
load balancing), each core a replica of the model on its own group of devices.

Place in the data flow: `api_server.start_engine` launches N `AsyncMPEngine`s, core r with `data_parallel_rank=r`
(its mesh on devices [r x tp, (r + 1) x tp), its KV events on the endpoint's port + r), and serves them through
this class, which the HTTP handlers use like one engine. Each request goes to the core holding the fewest
unfinished requests (vLLM's rule; the first on ties), and its aborts follow it there. Stats add up over the cores;
/kv_event_sources lists every core's publisher by rank, so vllm-router's kv_aware policy tracks each one.
One server keeps one port, one tokenizer and one set of metrics, as vLLM's; replicas on several hosts, or ones
that must fail alone, go behind vllm-router instead (README).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.async_engine import OutputObserver
from jaxserve.engine_core.core_client import AsyncMPEngine
from jaxserve.metrics.stats import StatsSnapshot, combined
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


class DataParallelEngine:
    def __init__(self, cores: list[AsyncMPEngine]):
        self.cores = cores
        sources = {rank: source for core in cores for rank, source in core.info.kv_event_sources.items()}
        self.info = dataclasses.replace(cores[0].info, kv_event_sources=sources)
        self._open = [0] * len(cores)  # unfinished requests per core
        self._owner: dict[str, int] = {}

    @classmethod
    def launch(cls, config: EngineConfig) -> DataParallelEngine:
        """Starts the cores one after the other (the later ones load the first one's compiled steps from the compile
        cache); a core that fails to start stops those already running."""
        cores = []
        try:
            with _shared_accelerators():
                for rank in range(config.data_parallel_size):
                    cores.append(AsyncMPEngine.launch(dataclasses.replace(config, data_parallel_rank=rank)))
        except BaseException:
            for core in cores:
                core.close()
            raise
        return cls(cores)

    @property
    def observer(self) -> OutputObserver | None:
        return self.cores[0].observer

    @observer.setter
    def observer(self, observer: OutputObserver | None) -> None:
        for core in self.cores:
            core.observer = observer

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """The first core that cannot serve makes the server unhealthy (as vLLM: one engine's death ends the server)."""
        for rank, core in enumerate(self.cores):
            reason = core.dead_reason
            if reason is not None:
                return f"data-parallel replica {rank}: {reason}"
        return None

    def make_stats(self) -> StatsSnapshot:
        return combined([core.make_stats() for core in self.cores])

    def backend_compiles(self) -> int:
        return sum(core.backend_compiles() for core in self.cores)

    async def generate(self, prompt: dict, sampling_params: SamplingParams | BeamSearchParams | None,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request on the core with the fewest unfinished requests, streamed as `AsyncMPEngine.generate`."""
        rank = min(range(len(self.cores)), key=self._open.__getitem__)
        self._open[rank] += 1
        self._owner[request_id] = rank
        try:
            async for output in self.cores[rank].generate(prompt, sampling_params, request_id, priority):
                yield output
        finally:
            self._open[rank] -= 1
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            await self.cores[rank].abort(request_id)

    async def reset_prefix_cache(self) -> int:
        """Every core's reset; the cached blocks dropped in all."""
        return sum(await asyncio.gather(*(core.reset_prefix_cache() for core in self.cores)))

    async def shutdown(self) -> None:
        await asyncio.gather(*(core.shutdown() for core in self.cores))

    def close(self) -> None:
        for core in self.cores:
            core.close()


@contextlib.contextmanager
def _shared_accelerators():
    """The cores' environment (a spawned process copies this one's): every core sees every GPU of the host and uses
    its own, so none may reserve most of each GPU's memory up front as JAX does by default
    (XLA_PYTHON_CLIENT_PREALLOCATE=false unless set); a core sizes its KV pool from its own devices."""
    saved = os.environ.get(PREALLOCATE_ENV)
    os.environ.setdefault(PREALLOCATE_ENV, "false")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(PREALLOCATE_ENV, None)
