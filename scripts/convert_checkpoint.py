"""Converts a Hugging Face model directory or a GGUF file into an orbax checkpoint directory that
`LLM(model=<dir>)` loads with every array restored directly into its sharding.

    python scripts/convert_checkpoint.py path/to/hf_model_dir /tmp/model-orbax
    python scripts/convert_checkpoint.py model.gguf /tmp/model-orbax --dtype bfloat16
    python scripts/convert_checkpoint.py --embedded /tmp/smollm2-orbax      # the embedded SmolLM2 GGUF
    python scripts/convert_checkpoint.py path/to/hf_model_dir /tmp/model-int8 --quantization int8   # stored quantized

The stored dtype is `--dtype` (the engine casts on restore when it serves another dtype). GGUF tensors
are dequantized, so the checkpoint holds plain float arrays; they are stored uncompressed unless
`--compress` (zstd: smaller, about 2x slower to restore on CPU). `--quantization` stores the quantized layers as the
scheme keeps them (int8 or float8 kernels with their float32 scales; `jaxserve.quantization`): the engine serves the
checkpoint so without quantizing at start-up, and a checkpoint of a model's compressed-tensors directory keeps its
stored values.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jaxserve, not an installed one

from jaxserve.config.quantization_config import QUANTIZATION_CHOICES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="Hugging Face model directory or .gguf file")
    parser.add_argument("output", help="new directory for the orbax checkpoint (must not exist)")
    parser.add_argument("--embedded", action="store_true", help="convert the embedded SmolLM2-135M GGUF")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compress", action="store_true", help="zstd-compress the arrays (smaller, slower to load)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="store the weights quantized in this scheme (as LLM(quantization=...) computes them)")
    return parser


def convert(source: str | None, output: Path, dtype: str, compress: bool = False,
            quantization: str | None = None) -> Path:
    """Loads `source` on the host (numpy), quantizes it if asked, and writes the orbax directory; returns its path."""
    from jaxserve.quantization.weights import apply_quantization
    from jaxserve.weights import load_model
    from jaxserve.weights.orbax_dir import save_orbax_dir

    if output.exists():
        raise FileExistsError(f"output {output} already exists; choose a new directory")
    loaded = load_model(source, dtype, quantization=quantization)
    config, params = apply_quantization(loaded.config, loaded.params, quantization)
    save_orbax_dir(output, config, params, loaded.tokenizer, source=loaded.path, dtype=dtype, compress=compress)
    return output


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.source is None) != args.embedded:
        print("error: give either a source path or --embedded", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = convert(args.source, Path(args.output), args.dtype, args.compress, args.quantization)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
