"""The per-user cache root of jaxserve: ``$XDG_CACHE_HOME/jaxserve`` (``~/.cache/jaxserve`` by default).

Place in the data flow: everything jaxserve keeps between runs lives under it, each user in its own
subdirectory: the compile cache (`compile_cache.default_cache_dir`), tokenizers converted from GGUF files
(`weights.tokenizer_cache_dir`), weights converted from GGUF files
(`weights.converted_cache`) and the native CPU kernel's shared library (`kernels_cpu`); the tokenizers and the
weights are named by `file_cache_name` after the file they come from.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/jaxserve``, or ``~/.cache/jaxserve`` when the variable is unset or empty."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve"


def file_cache_name(path: Path, *fields: object) -> str:
    """``<stem>-<key>``: the name of what is kept for the file ``path``, the key hashing its resolved path, size and
    mtime (a changed file misses) and ``fields`` (what else the kept thing depends on)."""
    stat = path.stat()
    parts = [path.resolve(), stat.st_size, stat.st_mtime_ns, *fields]
    return f"{path.stem}-{hashlib.sha256('|'.join(map(str, parts)).encode()).hexdigest()[:16]}"
