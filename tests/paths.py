"""Where the tests find the repository's own files, and the shared workloads laid beside the checkout."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
SHARED_WORKLOADS = REPO_ROOT.parent / "shared" / "workloads"
