"""Small bucket grids written as bucket files, so that an engine on a tiny model warms up in seconds (the tests and
the GPU check scripts). Standard library only."""

from __future__ import annotations

from pathlib import Path

SMALL_BUCKETS = """
block_size = 16
[decode]
batch_sizes = {decode_batch_sizes}
[prefill]
batch_sizes = [1]
lengths = [{chunk}]
[context]
lengths = [{context}]
"""


def small_bucket_file(directory: Path, decode_batch_sizes: tuple[int, ...] = (1, 4), mixed: bool = False, *,
                      chunk: int = 32, context: int = 128) -> str:
    """A small bucket grid (by default 3 executables: decode batch 1 and 4, prefill chunks of 32, context
    128): engine tests warm up in seconds. ``mixed``: plus one mixed bucket (4 rows, ``chunk`` tokens)."""
    path = Path(directory) / "small_buckets.toml"
    text = SMALL_BUCKETS.format(decode_batch_sizes=list(decode_batch_sizes), chunk=chunk, context=context)
    path.write_text(text + (f"[mixed]\nbatch_sizes = [4]\ntoken_counts = [{chunk}]\n" if mixed else ""))
    return str(path)
