"""Environment of the whole test suite, set when pytest loads this file, before any test module imports jax.

- ``JAXSERVE_COMPILE_CACHE_DIR``: one persistent compile cache for the whole session, a fresh temporary
  directory that every pytest-xdist worker and subprocess inherits (not the virtual-device check
  subprocesses: tests/paths.py says why; the controller creates it before the
  workers start and removes it at exit). Modules that build the same programs (the embedded model's CPU grid
  is in a dozen of them) compile them once: measured on a 2-core EPYC, the embedded model's 19 CPU buckets
  of then (22 now) compiled in 92 s and loaded from the cache in 2.7 s. JAX keys entries by the compiled
  program, so a test only ever loads the executable it would have compiled. The user's ``~/.cache`` is never
  touched; tests of the cache itself pass explicit directories (or set the variable themselves).
- ``JAXSERVE_WEIGHTS_CACHE_DIR``: likewise one converted-weights cache for the session (`weights.converted_cache`):
  the embedded GGUF is parsed and converted once per dtype, and later loads map the stored arrays.
- ``XLA_FLAGS`` gains ``--xla_cpu_use_fusion_emitters=false``: the programs the tests jit themselves (the kernels
  in interpret mode, the models' forward passes) compile with XLA:CPU's LLVM IR emitters, as the engine's float32
  programs do (`runner/compiler_options.py`; the runner names its options per program, so the flag changes none of
  its programs): measured on a 2-core EPYC, the kernel and family modules ran in 104 s instead of 127.
- ``JAX_PLATFORMS=cpu``: the tests are CPU tests; with libtpu or a GPU plugin installed, JAX would otherwise
  probe those runtimes (and print their warnings). Set either variable beforehand to override it.

`make test` runs the modules on two pytest-xdist workers (`--dist loadfile`: a module's engine fixtures stay
in one process), the slowest first (`SLOWEST_MODULES`); `reference_dir` is where they share reference outputs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from tests.paths import REPO_ROOT


def _session_cache(variable: str, prefix: str) -> None:
    """Creates a session cache directory unless one is inherited (xdist workers) or set by the caller."""
    if variable in os.environ:
        return
    directory = tempfile.mkdtemp(prefix=prefix)
    os.environ[variable] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


_session_cache("JAXSERVE_COMPILE_CACHE_DIR", "jaxserve-test-compile-cache-")
_session_cache("JAXSERVE_WEIGHTS_CACHE_DIR", "jaxserve-test-weights-cache-")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()


# The slowest modules, slowest first (seconds of their slowest tests in one pytest-xdist worker while the other runs
# too, `--durations=80`, 2-core AMD EPYC, 2026-11-30), run before the others so that the two workers end together:
# xdist hands whole modules out in collection order (`make test` passes --no-loadscope-reorder; xdist's default
# order, by number of tests, left the one-test tensor-parallel module, 5 minutes then, to run alone at the end).
SLOWEST_MODULES = (
    "tests/e2e/test_embedded_model.py",  # 200
    "tests/distributed/test_tensor_parallel.py",  # 138
    "tests/speculative/test_embedded_speculation.py",  # 88
    "tests/compilation/test_targets.py",  # 64
    "tests/compilation/test_compile_cache.py",  # 60
    "tests/compilation/test_precompile_draft.py",  # 53
    "tests/distributed/test_multihost_serving.py",  # 53
    "tests/speculative/test_spec_decode.py",  # 43
    "tests/entrypoints/test_router.py",  # 42: its replicas load test_embedded_model's steps from the compile cache
    "tests/kernels/test_ragged_paged_attention.py",  # 39
    "tests/models/test_family_engines.py",  # 34
    "tests/e2e/test_bfloat16_accuracy.py",  # 33
    "tests/entrypoints/test_engine_core_process.py",  # 33
    "tests/models/test_gemma4.py",  # 32
    "tests/engine/test_gemma4_engine.py",  # 31
    "tests/entrypoints/test_serve_cli.py",  # 26
    "tests/models/test_families.py",  # 25
    "tests/speculative/test_draft_model.py",  # 25
    "tests/runner/test_pallas_engine.py",  # 24
    "tests/models/test_qwen3_next.py",  # 20
)


def pytest_collection_modifyitems(items) -> None:
    """SLOWEST_MODULES first, in their order; the other modules keep theirs (the sort is stable)."""
    missing = [module for module in SLOWEST_MODULES if not (REPO_ROOT / module).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_MODULES names modules that do not exist: {missing}")
    rank = {module: i for i, module in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    """A directory every test module of this session shares, across pytest-xdist workers too (the workers'
    base temporary directories are siblings): reference outputs computed by one module are read by the others
    (`tests/embedded_reference.py`)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    shared.mkdir(exist_ok=True)
    return shared
