"""Environment of the whole test suite, set when pytest loads this file, before any test module imports jax.

- ``JAXSERVE_COMPILE_CACHE_DIR=""``: the persistent compile cache is on by default for users
  (``~/.cache/jaxserve/compile_cache``); ordinary tests run without one, so they never write to the real
  ``~/.cache`` and every test compiles what it measures. Tests of the cache pass explicit directories (or set
  the variable themselves); subprocesses inherit it.
- ``JAX_PLATFORMS=cpu``: the tests are CPU tests; with libtpu or a GPU plugin installed, JAX would otherwise
  probe those runtimes (and print their warnings). Set either variable beforehand to override it.

`make test` runs the modules on two pytest-xdist workers (`--dist loadfile`: a module's engine fixtures stay
in one process); `reference_dir` is where they share reference outputs.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAXSERVE_COMPILE_CACHE_DIR", "")
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
