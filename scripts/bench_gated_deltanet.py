"""The gated DeltaNet's chunkwise prefill (jaxserve/models/gated_deltanet.py) at Qwen3-Next-80B's shape (nk 16, nv 32,
dk 128, dv 128, K 4), for one sequence of 2048 tokens and for 16 of 128: compiled deviceless for TPU, and timed
against the plain token-by-token form on this host's CPU.

TPU (``--topology``, default v6e:2x2; needs libtpu, no TPU): one linear-attention layer's prefill from its pre-conv
rows, as the engine's prefill step will run it between the projections: `causal_conv`, `gates`, `prepare_qk`,
`gated_delta_chunked` (bfloat16 rows and conv state, float32 recurrent state; both states donated, as the slot
pool's will be), jitted with in / out shardings on a mesh of the topology's first device, lowered from
ShapeDtypeStructs and compiled by the real TPU compiler; also the decode step of 16 rows (`gated_delta_step` after
the conv). The table gives the compile seconds and `memory_analysis()` (arguments, outputs, temporaries, aliased).

CPU: the recurrence alone (`prepare_qk` then the form, float32, from q, k, v, g, beta and a state) in the chunkwise
form and in the plain one (`gated_delta_recurrent`: a scan over the tokens), on the same inputs in the same run, their
calls interleaved so that a change of load hits both alike: median milliseconds of ``--repeats`` calls after a
compiling one, the plain form's time over the chunkwise form's, and their max |difference| (output and state). The
host's load average before and after is printed with them (on a shared host, another process taking a core slows a
multi-threaded program more than its share). ``--single-thread`` runs XLA:CPU on one thread
(`--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`).

    python scripts/bench_gated_deltanet.py
    python scripts/bench_gated_deltanet.py --skip-tpu --single-thread --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from host_cpu import cpu_name  # noqa: E402

from jaxserve.models import gated_deltanet as gdn  # noqa: E402

QWEN3_NEXT_80B = gdn.GatedDeltaNetDims(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128)
TAPS = 4  # linear_conv_kernel_dim
CASES = ((1, 2048), (16, 128))  # (sequences, tokens each)
MB = 1e6


# --------------------------------------------------------------------------------------------------------- TPU
def prefill(mixed, a, b, conv_weight, a_log, dt_bias, conv_state, state, num_valid, dims=QWEN3_NEXT_80B,
            chunk: int = gdn.CHUNK):
    """A layer's prefill between its projections: (core output bf16[S, T, nv, dv], conv_state, state)."""
    s, t = mixed.shape[:2]
    conv_out, conv_state = gdn.causal_conv(mixed, conv_weight, conv_state, num_valid)
    q, k, v = jnp.split(conv_out, [dims.key_dim, 2 * dims.key_dim], axis=-1)
    q, k = gdn.prepare_qk(q.reshape(s, t, dims.num_key_heads, -1), k.reshape(s, t, dims.num_key_heads, -1),
                          dims.num_value_heads)
    g, beta = gdn.gates(a, b, a_log, dt_bias)
    v = v.reshape(s, t, dims.num_value_heads, -1)
    out, state = gdn.gated_delta_chunked(q, k, v, g, beta, state, num_valid, chunk)
    return out.astype(mixed.dtype), conv_state, state


def decode(mixed, a, b, conv_weight, a_log, dt_bias, conv_state, state, num_valid, dims=QWEN3_NEXT_80B):
    """A layer's decode step between its projections (one token per row)."""
    conv_out, conv_state = gdn.causal_conv(mixed, conv_weight, conv_state, num_valid)
    q, k, v = jnp.split(conv_out[:, 0], [dims.key_dim, 2 * dims.key_dim], axis=-1)
    s = q.shape[0]
    q, k = gdn.prepare_qk(q.reshape(s, dims.num_key_heads, -1), k.reshape(s, dims.num_key_heads, -1),
                          dims.num_value_heads)
    g, beta = gdn.gates(a[:, 0], b[:, 0], a_log, dt_bias)
    out, state = gdn.gated_delta_step(q, k, v.reshape(s, dims.num_value_heads, -1), g, beta, state, num_valid > 0)
    return out.astype(mixed.dtype)[:, None], conv_state, state


def compile_for_tpu(fn, topology: str, seqs: int, tokens: int, dims=QWEN3_NEXT_80B, taps: int = TAPS):
    """(compiled, seconds) of ``fn`` at ``seqs`` x ``tokens`` for the topology's first device."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology, "tpu").devices[:1]
    rep = NamedSharding(Mesh(np.array(device), ("x",)), P())
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    nv, bf16 = dims.num_value_heads, jnp.bfloat16
    args = (arg((seqs, tokens, dims.conv_dim), bf16), arg((seqs, tokens, nv), bf16), arg((seqs, tokens, nv), bf16),
            arg((dims.conv_dim, taps), bf16), arg((nv,), jnp.float32), arg((nv,), jnp.float32),
            arg((seqs, taps - 1, dims.conv_dim), bf16),
            arg((seqs, nv, dims.key_head_dim, dims.value_head_dim), jnp.float32), arg((seqs,), jnp.int32))
    jitted = jax.jit(fn, in_shardings=(rep,) * len(args), out_shardings=(rep, rep, rep), donate_argnums=(6, 7))
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - start


def main_tpu(topology: str) -> None:
    print(f"TPU {topology}, deviceless, Qwen3-Next-80B's linear-attention layer (bf16 rows, f32 state; MB = 1e6 B)")
    print("step      sequences x tokens  compile s  arguments MB  outputs MB  temp MB  aliased MB  code MB")
    for name, fn, cases in (("prefill", prefill, CASES), ("decode", decode, ((16, 1),))):
        for seqs, tokens in cases:
            compiled, seconds = compile_for_tpu(fn, topology, seqs, tokens)
            mem = compiled.memory_analysis()
            print(f"{name:8}  {seqs:>4} x {tokens:<12}  {seconds:9.1f}  {mem.argument_size_in_bytes / MB:12.1f}  "
                  f"{mem.output_size_in_bytes / MB:10.1f}  {mem.temp_size_in_bytes / MB:7.1f}  "
                  f"{mem.alias_size_in_bytes / MB:10.1f}  {mem.generated_code_size_in_bytes / MB:7.2f}")


# --------------------------------------------------------------------------------------------------------- CPU
def recurrence_inputs(seqs: int, tokens: int, dims=QWEN3_NEXT_80B, seed: int = 0):
    """Random float32 q, k [S, T, nk, dk], v [S, T, nv, dv], the gates' g and beta [S, T, nv] (decays per token
    from ~0.9999 to ~0.2), a state [S, nv, dk, dv] and num_valid (every slot valid)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    nk, nv, dk, dv = dims
    a_log = jnp.log(jnp.asarray(np.geomspace(0.05, 14.0, nv), jnp.float32))
    dt_bias = jnp.log(jnp.expm1(jnp.asarray(np.geomspace(0.002, 0.1, nv), jnp.float32)))
    g, beta = gdn.gates(0.5 * normal(seqs, tokens, nv), normal(seqs, tokens, nv), a_log, dt_bias)
    return (normal(seqs, tokens, nk, dk), normal(seqs, tokens, nk, dk), normal(seqs, tokens, nv, dv), g, beta,
            0.3 * normal(seqs, nv, dk, dv), jnp.full((seqs,), tokens, jnp.int32))


def recurrence(form):
    def run(q, k, v, g, beta, state, num_valid):
        q, k = gdn.prepare_qk(q, k, v.shape[2])
        return form(q, k, v, g, beta, state, num_valid)

    return jax.jit(run)


def main_cpu(repeats: int) -> None:
    threads = "one thread" if "intra_op_parallelism_threads=1" in os.environ.get("XLA_FLAGS", "") else "all threads"
    print(f"\nCPU ({cpu_name()}; XLA on {threads}), the recurrence alone, float32, Qwen3-Next-80B's heads: plain (a "
          f"scan over the tokens) against chunkwise (chunks of {gdn.CHUNK}), median of {repeats} calls")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("sequences x tokens  chunkwise ms  plain ms  plain / chunkwise  max |diff| output  state")
    chunked, plain = recurrence(gdn.gated_delta_chunked), recurrence(gdn.gated_delta_recurrent)
    for seqs, tokens in CASES:
        inputs = recurrence_inputs(seqs, tokens)
        out_c, state_c = jax.block_until_ready(chunked(*inputs))  # compiles
        out_p, state_p = jax.block_until_ready(plain(*inputs))
        times = {chunked: [], plain: []}
        for _ in range(repeats):
            for fn in (chunked, plain):
                start = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                times[fn].append(1e3 * (time.perf_counter() - start))
        ms_c, ms_p = statistics.median(times[chunked]), statistics.median(times[plain])
        print(f"{seqs:>4} x {tokens:<12}  {ms_c:12.1f}  {ms_p:8.1f}  {ms_p / ms_c:17.2f}  "
              f"{float(jnp.abs(out_c - out_p).max()):17.1e}  {float(jnp.abs(state_c - state_p).max()):5.1e}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v6e:2x2", help="a TPU topology as JAX names them")
    parser.add_argument("--skip-tpu", action="store_true", help="the CPU timings only")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each form per case (the median)")
    parser.add_argument("--single-thread", action="store_true", help="XLA:CPU on one thread (the CPU timings)")
    args = parser.parse_args()
    if args.single_thread:  # read when the CPU backend starts: before the first computation
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1").strip()
    if not args.skip_tpu:
        main_tpu(args.topology)
    main_cpu(args.repeats)


if __name__ == "__main__":
    main()
