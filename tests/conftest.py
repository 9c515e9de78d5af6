"""Environment of the whole test suite, set when pytest loads this file, before any test module imports jax.

- ``JAXSERVE_COMPILE_CACHE_DIR=""``: the persistent compile cache is on by default for users
  (``~/.cache/jaxserve/compile_cache``); ordinary tests run without one, so they never write to the real
  ``~/.cache`` and every test compiles what it measures. Tests of the cache pass explicit directories (or set
  the variable themselves); subprocesses inherit it.
- ``JAX_PLATFORMS=cpu``: the tests are CPU tests; with libtpu or a GPU plugin installed, JAX would otherwise
  probe those runtimes (and print their warnings). Set either variable beforehand to override it.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAXSERVE_COMPILE_CACHE_DIR", "")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
