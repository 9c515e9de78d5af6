"""Where the tests find the repository's own files, and the shared workloads laid beside the checkout; the
scripts loaded as modules (they are not a package); checks run on several virtual CPU devices in a subprocess.
(What the scripts share with the tests lives in `jaxserve.testing`.)"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
SHARED_WORKLOADS = REPO_ROOT.parent / "shared" / "workloads"


def load_script(name: str):
    """`scripts/<name>.py` executed as the module `name` (registered in sys.modules, where dataclasses look their
    module up); the scripts import their neighbours (`baselines`) as top-level modules."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def assert_checks_pass_on_cpu_devices(checks: Path, num_devices: int, num_checks: int, timeout: int) -> None:
    """Runs the pytest file `checks` in a subprocess on `num_devices` virtual CPU devices (the XLA flag must be
    set before JAX starts; this process keeps its single device) and requires exactly `num_checks` to pass.

    The subprocess runs without the session's compile cache: an executable sharded over several CPU devices,
    stored and then loaded again in the same process, aborts in JAX's `deserialize_and_load` (jax 0.10.2;
    the tensor-parallel checks build the same configuration more than once)."""
    xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
    env = {**os.environ, "XLA_FLAGS": xla_flags, "PYTHONPATH": str(REPO_ROOT), "JAXSERVE_COMPILE_CACHE_DIR": ""}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    report = result.stdout[-8000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert re.search(rf"\b{num_checks} passed\b", result.stdout), report
    assert not re.search(r"\b(failed|skipped|error)", result.stdout.splitlines()[-1]), report
