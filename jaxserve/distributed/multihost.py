"""Multi-host start-up: joins this process to the others with `jax.distributed.initialize`, so that
`jax.devices()` lists every host's chips and one engine's mesh spans them (a TPU pod slice).

Place in the data flow: the engine builder (`engine/engine_builder.py`) calls `initialize_distributed` first, before
anything touches a JAX backend, when `EngineConfig.distributed_init` is set (`--distributed-init`) or the environment
has `JAXSERVE_DISTRIBUTED_INIT=1`. Every host then runs the same program with the same requests (JAX's
multi-controller model): each host's engine schedules identically and feeds the same padded batches, and the compiled
step runs once across all chips.

Settings, each from the engine config or else from the environment:

    coordinator_address  JAXSERVE_COORDINATOR_ADDRESS   host:port of process 0
    num_processes        JAXSERVE_NUM_PROCESSES
    process_id           JAXSERVE_PROCESS_ID

Left unset, `jax.distributed.initialize` detects them itself on Cloud TPU pods, SLURM and Open MPI. Every process
must join within `JAXSERVE_DISTRIBUTED_TIMEOUT_S` seconds (default 300, JAX's), or JAX ends the waiting ones.
"""

from __future__ import annotations

import os

import jax

from jaxserve.logger import init_logger

logger = init_logger("jaxserve.distributed.multihost")

ENABLE_ENV = "JAXSERVE_DISTRIBUTED_INIT"
TIMEOUT_ENV = "JAXSERVE_DISTRIBUTED_TIMEOUT_S"
DEFAULT_JOIN_TIMEOUT_S = 300
SETTING_ENV = {
    "coordinator_address": "JAXSERVE_COORDINATOR_ADDRESS",
    "num_processes": "JAXSERVE_NUM_PROCESSES",
    "process_id": "JAXSERVE_PROCESS_ID",
}


def join_timeout_s() -> int:
    """Seconds every process has to join (`JAXSERVE_DISTRIBUTED_TIMEOUT_S`; default JAX's 300)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_JOIN_TIMEOUT_S
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a whole number of seconds, got {value!r}") from None


def distributed_init_requested(flag: bool) -> bool:
    return flag or os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def distributed_settings(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> dict:
    """The arguments for `jax.distributed.initialize`: given values first, then the environment."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    settings = {}
    for name, value in given.items():
        if value is None and os.environ.get(SETTING_ENV[name]):
            value = os.environ[SETTING_ENV[name]]
            if name != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"{SETTING_ENV[name]} must be an integer, got {value!r}") from None
        if value is not None:
            settings[name] = value
    return settings


def initialize_distributed(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Joins the process group once (a second call in the same process is a no-op)."""
    if jax.distributed.is_initialized():
        return
    settings = distributed_settings(coordinator_address, num_processes, process_id)
    timeout = join_timeout_s()
    logger.info("joining jax.distributed (%s): every process must join within %d s (%s), or JAX ends this one with "
                "DEADLINE_EXCEEDED", ", ".join(f"{k}={v}" for k, v in settings.items()) or "detected settings",
                timeout, TIMEOUT_ENV)
    jax.distributed.initialize(**settings, initialization_timeout=timeout)
    logger.info(
        "process %d of %d: %d local and %d global devices", jax.process_index(), jax.process_count(),
        jax.local_device_count(), jax.device_count(),
    )
