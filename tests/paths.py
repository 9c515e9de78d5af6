"""Where the tests find the repository's own files, and the shared workloads laid beside the checkout; the
scripts loaded as modules (they are not a package)."""

import importlib.util
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
