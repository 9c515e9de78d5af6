"""Converts a Hugging Face model directory or a GGUF file into an orbax checkpoint directory that
`LLM(model=<dir>)` loads with every array restored directly into its sharding.

    python scripts/convert_checkpoint.py path/to/hf_model_dir /tmp/model-orbax
    python scripts/convert_checkpoint.py model.gguf /tmp/model-orbax --dtype bfloat16
    python scripts/convert_checkpoint.py --embedded /tmp/smollm2-orbax      # the embedded SmolLM2 GGUF

The stored dtype is `--dtype` (the engine casts on restore when it serves another dtype). GGUF tensors
are dequantized, so the checkpoint holds plain float arrays; they are stored uncompressed unless
`--compress` (zstd: smaller, about 2x slower to restore on CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="Hugging Face model directory or .gguf file")
    parser.add_argument("output", help="new directory for the orbax checkpoint (must not exist)")
    parser.add_argument("--embedded", action="store_true", help="convert the embedded SmolLM2-135M GGUF")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compress", action="store_true", help="zstd-compress the arrays (smaller, slower to load)")
    return parser


def convert(source: str | None, output: Path, dtype: str, compress: bool = False) -> Path:
    """Loads `source` on the host (numpy) and writes the orbax directory; returns its path."""
    from jaxserve.weights import load_model
    from jaxserve.weights.orbax_dir import save_orbax_dir

    if output.exists():
        raise FileExistsError(f"output {output} already exists; choose a new directory")
    loaded = load_model(source, dtype)
    save_orbax_dir(
        output, loaded.config, loaded.params, loaded.tokenizer, source=loaded.path, dtype=dtype, compress=compress
    )
    return output


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.source is None) != args.embedded:
        print("error: give either a source path or --embedded", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = convert(args.source, Path(args.output), args.dtype, args.compress)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
