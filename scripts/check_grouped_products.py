"""Deviceless: what one product x @ W costs on a TPU chip with W stored as `quantization="gguf"` keeps it (int8
codes, a scale and an offset per 32 inputs), rebuilt first (the CPU formulation) or group by group (TPU and GPU),
against a bfloat16 W and per-channel int8, from XLA's compile for the chip: temporaries (what the product writes to
HBM besides its output) and the bytes its cost model counts as accessed. No TPU needed (libtpu compiles).

    python scripts/check_grouped_products.py                            # a Llama-3-8B MLP matrix, 16 / 256 / 2048 rows
    python scripts/check_grouped_products.py --target v6e:2x2 --shape 4096,4096 --rows 1,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.compilation.targets import resolve_target  # noqa: E402
from jaxserve.config.quantization_config import GGUF_GROUP_SIZE, parse_quantization  # noqa: E402
from jaxserve.models.common import matmul  # noqa: E402
from jaxserve.quantization.matmul import grouped_matmul, quantized_matmul  # noqa: E402


def products(inputs: int, outputs: int) -> dict:
    """name -> (function, operand shapes and dtypes after x)."""
    groups = ((inputs // GGUF_GROUP_SIZE, outputs), jnp.float32)
    grouped = [((inputs, outputs), jnp.int8), groups, groups]
    int8 = parse_quantization("int8")

    def gguf(platform):
        scheme = parse_quantization("gguf").for_platform(platform)
        return lambda x, c, s, o: grouped_matmul(x, c, s, o, scheme, jnp.bfloat16, matmul)

    return {
        "bfloat16": (matmul, [((inputs, outputs), jnp.bfloat16)]),
        "int8 per channel": (lambda x, c, s: quantized_matmul(x, c, s, int8, jnp.bfloat16, matmul),
                             [((inputs, outputs), jnp.int8), ((outputs,), jnp.float32)]),
        "gguf, rebuilt (CPU)": (gguf("cpu"), grouped),
        "gguf, group by group": (gguf("tpu"), grouped),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="v5e:2x2")
    parser.add_argument("--shape", default="4096,14336", help="inputs,outputs of W")
    parser.add_argument("--rows", default="16,256,2048")
    args = parser.parse_args(argv)
    inputs, outputs = (int(n) for n in args.shape.split(","))
    sharding = jax.sharding.SingleDeviceSharding(resolve_target(args.target).devices[0])
    print(f"x [rows, {inputs}] @ W [{inputs}, {outputs}] on one {args.target} chip (deviceless)")
    print(f"{'rows':>5}  {'product':<22} {'temporaries MB':>15} {'bytes accessed MB':>18}")
    for rows in (int(n) for n in args.rows.split(",")):
        for name, (function, shapes) in products(inputs, outputs).items():
            operands = [((rows, inputs), jnp.bfloat16), *shapes]
            structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in operands]
            compiled = jax.jit(function).lower(*structs).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            temporaries = compiled.memory_analysis().temp_size_in_bytes
            print(f"{rows:>5}  {name:<22} {temporaries / 1e6:>15.1f} {cost['bytes accessed'] / 1e6:>18.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
