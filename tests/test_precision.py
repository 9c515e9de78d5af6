"""dtype="auto": bfloat16 where the device has a bf16 matrix unit, float32 elsewhere (jaxserve.precision)."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.precision import bf16_matrix_unit, cpu_flags, resolve_dtype, resolve_engine_dtype

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
COOPER_LAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n"


@dataclasses.dataclass
class FakeDevice:
    platform: str
    compute_capability: str | None = None


def test_cpu_flags_parse_the_first_processor():
    assert cpu_flags(SAPPHIRE_RAPIDS) >= {"amx_bf16", "avx512_bf16"}
    assert "amx_bf16" not in cpu_flags(ICE_LAKE)
    assert cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize(
    ("device", "cpuinfo", "expected"),
    [
        (FakeDevice("cpu"), SAPPHIRE_RAPIDS, ("bfloat16", "CPU with amx_bf16 and avx512_bf16")),
        (FakeDevice("cpu"), COOPER_LAKE, ("bfloat16", "CPU with avx512_bf16")),
        (FakeDevice("cpu"), ICE_LAKE, ("float32", "no bfloat16 matrix unit on this cpu device")),
        (FakeDevice("tpu"), "", ("bfloat16", "TPU MXU")),
        (FakeDevice("gpu", "9.0"), "", ("bfloat16", "GPU tensor cores (compute capability 9.0)")),
        (FakeDevice("gpu", "8.0"), "", ("bfloat16", "GPU tensor cores (compute capability 8.0)")),
        (FakeDevice("gpu", "7.5"), "", ("float32", "no bfloat16 matrix unit on this gpu device")),
    ],
)
def test_auto_picks_bfloat16_only_with_a_bf16_matrix_unit(device, cpuinfo, expected):
    dtype, reason = resolve_dtype("auto", device, cpu_flags(cpuinfo))
    assert dtype == expected[0]
    assert reason.startswith("dtype=auto: ") and expected[1] in reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_any_device(dtype):
    for device in (FakeDevice("cpu"), FakeDevice("gpu", "7.0"), FakeDevice("tpu")):
        assert resolve_dtype(dtype, device, frozenset()) == (dtype, "as requested")


def test_engine_config_defaults_to_auto_and_resolves_for_this_machine():
    config = EngineConfig()
    assert config.dtype == "auto"
    device = jax.devices()[0]
    resolved = resolve_engine_dtype(config, device)
    expected = "bfloat16" if bf16_matrix_unit(device) is not None else "float32"
    assert resolved.dtype == expected
    assert dataclasses.replace(resolved, dtype="auto") == config


def test_unknown_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unsupported dtype 'float16'; supported: auto, float32, bfloat16"):
        EngineConfig(dtype="float16")
