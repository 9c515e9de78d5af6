"""A per-step trace, to find where a server's latency goes: with `JAXSERVE_STEP_TRACE=path.jsonl` in the
environment, the engine appends one JSON line per step it completes.

Place in the data flow: `LLMEngine._launch` opens a record when it dispatches a step (what the scheduler chose:
bucket, decode rows, prefill tokens, queue) and `LLMEngine._complete` closes it once the step's tokens are on
the host. `scripts/trace_steps.py` summarizes a trace. Times are wall-clock seconds (`time.time()`), so they line
up with a benchmark client's timestamps on the same host. Off by default: without the variable nothing is timed.

One line:
    {"launched": 1764141234.51, "dispatch_s": 0.004, "ready": 1764141234.60, "kind": "mixed",
     "bucket": {"num_tokens": 128, "batch_size": 16, "context_len": 2048}, "decode_rows": 3, "prefill_tokens": 81,
     "prefill_chunks": 1, "padded_tokens": 44, "waiting": 0, "running": 4}
`ready - launched` is the step's time on the device plus what the host did meanwhile (with async scheduling the
next step was planned and dispatched in between); the gap between one step's `ready` and the next's is what a
decoding stream sees as its inter-token latency.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from jaxserve.core.schedule import Schedule

TRACE_ENV = "JAXSERVE_STEP_TRACE"


class StepTrace:
    """Appends step records to a JSON-lines file (line-buffered: a killed server loses at most one line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the engine's lifetime)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def launched(self, schedule: Schedule, started: float, num_waiting: int, num_running: int) -> dict:
        """The record of a step dispatched now; `started`: `time.time()` when the engine began dispatching it."""
        return {
            "launched": started, "dispatch_s": round(time.time() - started, 6), "ready": None,
            "kind": schedule.kind, "bucket": dataclasses.asdict(schedule.bucket),
            "decode_rows": len(schedule.decode_seqs),
            "prefill_tokens": schedule.num_prefill_tokens,
            "prefill_chunks": len(schedule.prefill_chunks), "padded_tokens": schedule.num_padded_tokens,
            "waiting": num_waiting, "running": num_running,
        }

    def completed(self, record: dict) -> None:
        record["ready"] = time.time()
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()

