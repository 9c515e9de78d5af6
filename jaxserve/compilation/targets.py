"""Compile targets that this host does not have: a TPU topology (compiled deviceless) or CUDA (lowered only).

Place in the data flow: `jaxserve precompile --target NAME` (`target_compile.py`) resolves NAME here into
the devices to build for and their memory. With `jax[tpu]` installed (libtpu), any CPU host can compile
for a TPU slice it does not have: `jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")` gives
the slice's devices, a mesh over them gives shardings, and `jit(...).lower(...).compile()` runs the real
TPU compiler and Mosaic. CUDA has no such topology: its steps are lowered (`lowering_platforms=("cuda",)`)
on this host's CPU devices, which surfaces lowering errors of the Triton kernels without a GPU.

`quiet_libtpu_without_tpu` (called when jaxserve is imported) keeps libtpu from printing start-up errors on
a host with libtpu installed and no TPU chip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

GIB = 1 << 30
# HBM a program may use on one device of each TPU generation (device_kind -> bytes): what the TPU compiler
# itself reports as "available HBM" when a program does not fit (measured with libtpu 0.0.42.1; a v4 chip
# is two devices of 15.25 GiB each).
TPU_HBM_BYTES_PER_DEVICE = {
    "TPU v4": int(15.25 * GIB),
    "TPU v5 lite": int(15.75 * GIB),
    "TPU v5": int(95.74 * GIB),  # v5p
    "TPU v6 lite": int(31.25 * GIB),
}
GOOGLE_PCI_VENDOR = "0x1ae0"
CUDA_TARGET = "cuda"
# The GPU a CUDA lowering sizes its KV pool for (lowering only: the pool's size changes no kernel code).
CUDA_HBM_BYTES = 80 * GIB  # H100


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """The devices a precompile builds for, their platform and the memory of each device."""

    name: str
    platform: str  # "tpu" or "cuda"
    devices: tuple
    device_kind: str
    hbm_bytes_per_device: int

    @property
    def lower_only(self) -> bool:
        """CUDA steps are lowered, not compiled: XLA's GPU compiler needs a GPU."""
        return self.platform == "cuda"


def quiet_libtpu_without_tpu() -> None:
    """On a host with libtpu installed and no TPU chip, tell libtpu it runs alone (the worker host name
    and an accelerator type it only uses to look for local chips), so that initializing JAX, or a
    deviceless TPU compile, prints no TPU start-up errors; and let several processes load it (its lock
    file guards chips, and there are none: two deviceless compiles may run at once). Variables already set
    are kept; hosts with TPU chips are untouched."""
    if importlib.util.find_spec("libtpu") is None or _has_tpu_chips():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _has_tpu_chips() -> bool:
    """A Google (TPU) PCI device or an accel device node, as JAX's own TPU detection looks for (without
    importing JAX: ``import jaxserve`` stays cheap)."""
    vendors = Path("/sys/bus/pci/devices").glob("*/vendor")
    if any(_read(path) == GOOGLE_PCI_VENDOR for path in vendors):
        return True
    return any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def resolve_target(name: str, num_host_devices: int = 1) -> CompileTarget:
    """A TPU topology in JAX's names ("v5e:2x2", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1", ...) or "cuda"."""
    if name == CUDA_TARGET:
        import jax

        return CompileTarget(name, "cuda", tuple(jax.devices("cpu")[:num_host_devices]), "cuda", CUDA_HBM_BYTES)
    from jax.experimental import topologies

    quiet_libtpu_without_tpu()
    try:
        topology = topologies.get_topology_desc(name, "tpu")
    except Exception as err:  # noqa: BLE001 - libtpu missing, or a name it does not know
        raise ValueError(
            f"cannot compile for TPU topology {name!r} ({type(err).__name__}: {err}); install jaxserve[tpu] "
            "(libtpu) and name a topology as JAX does, e.g. v5e:2x2, v6e:2x2, v5p:2x2x1, or use --target cuda"
        ) from err
    devices = tuple(topology.devices)
    kind = devices[0].device_kind
    if kind not in TPU_HBM_BYTES_PER_DEVICE:
        raise ValueError(f"unknown HBM size of {kind!r} (known: {', '.join(TPU_HBM_BYTES_PER_DEVICE)})")
    return CompileTarget(name, "tpu", devices, kind, TPU_HBM_BYTES_PER_DEVICE[kind])


def auto_tensor_parallel_size(num_devices: int, *head_counts: int) -> int:
    """The most devices (a divisor of ``num_devices``) that every one of ``head_counts`` divides by."""
    return max(n for n in range(1, num_devices + 1) if num_devices % n == 0 and all(c % n == 0 for c in head_counts))
