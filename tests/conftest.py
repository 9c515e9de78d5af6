"""Environment of the whole test suite, set when pytest loads this file, before any test module imports jax.

- ``JAXSERVE_COMPILE_CACHE_DIR``: one persistent compile cache for the whole session, a fresh temporary
  directory that every pytest-xdist worker and subprocess inherits (not the virtual-device check
  subprocesses: tests/paths.py says why; the controller creates it before the
  workers start and removes it at exit). Modules that build the same programs (the embedded model's CPU grid
  is in a dozen of them) compile them once: measured on a 2-core EPYC, the embedded model's 19 CPU buckets
  of then (22 now) compiled in 92 s and loaded from the cache in 2.7 s. JAX keys entries by the compiled
  program, so a test only ever loads the executable it would have compiled. The user's ``~/.cache`` is never
  touched; tests of the cache itself pass explicit directories (or set the variable themselves).
- ``JAX_PLATFORMS=cpu``: the tests are CPU tests; with libtpu or a GPU plugin installed, JAX would otherwise
  probe those runtimes (and print their warnings). Set either variable beforehand to override it.

`make test` runs the modules on two pytest-xdist workers (`--dist loadfile`: a module's engine fixtures stay
in one process); `reference_dir` is where they share reference outputs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest


def _session_compile_cache() -> None:
    """Creates the session's compile cache unless one is inherited (xdist workers) or set by the caller."""
    if "JAXSERVE_COMPILE_CACHE_DIR" in os.environ:
        return
    directory = tempfile.mkdtemp(prefix="jaxserve-test-compile-cache-")
    os.environ["JAXSERVE_COMPILE_CACHE_DIR"] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


_session_compile_cache()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    """A directory every test module of this session shares, across pytest-xdist workers too (the workers'
    base temporary directories are siblings): reference outputs computed by one module are read by the others
    (`tests/embedded_reference.py`)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    shared.mkdir(exist_ok=True)
    return shared
