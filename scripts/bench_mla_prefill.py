"""MLA prefill attention of one layer in its two forms, weight-absorbed (the engine's) and expanded (vLLM's prefill on
GPU), side by side in one run.

The inputs of both forms are what a prefill chunk of Q tokens at the end of a context of C tokens has at hand: the
chunk's queries q_nope [Q, H, nope] and q_pe [Q, H, dr] (after rotary), the context's latent rows [C, r + dr] as the
latent pool holds them gathered ([c | k_pe]: the latent after its norm and the rotary key, one for every head), and
kv_b_proj's weight [r, H * (nope + v)] (per head W_UK [r, nope] then W_UV [r, v]); the output of both is each head's
values [Q, H, v] (what o_proj takes). Causal: query i, at position C - Q + i, sees the keys at positions <= its own.

- absorbed (`jaxserve.models.deepseek.MLAttention`): q_lat = W_UK^T q_nope, scores [q_lat | q_pe] . [c | k_pe] (one
  key of r + dr for every head: multi-query attention over the latent rows), o_lat = sum_t p_t c_t, values
  W_UV o_lat. Dense FLOPs 2 Q C H (r + dr) + 2 Q C H r, plus 2 Q H nope r and 2 Q H r v for the two projections.
- expanded: every context row expanded to per-head keys k_nope = W_UK c and values v = W_UV c, keys
  [k_nope | k_pe], then ordinary multi-head attention of head dim nope + dr. Dense FLOPs 2 C r H (nope + v) for the
  expansion, plus 2 Q C H (nope + dr) + 2 Q C H v.

So the absorbed form does (r + dr + r) / (nope + dr + v) times the attention FLOPs of the expanded one (3.4x at
DeepSeek's shapes), and the expanded form pays r (nope + v) per context row and head where the absorbed one pays as
much per query row and head: the expanded form does fewer FLOPs where r (nope + v) (1/Q - 1/C) < 2 r - nope - v,
i.e. for every first chunk (Q = C) and, whatever C and H, for Q > 171 at DeepSeek's shapes.

Both forms are plain dense jnp (einsums with float32 accumulation, softmax in float32, the probabilities cast to the
input dtype for the value product, as an attention kernel does), jitted. The shapes are DeepSeek-V2-Lite's (16 heads,
kv_lora_rank 512, rope 64, nope 128, v 128); ``--heads 16 128`` adds V3's 128 heads. Each case first checks that the
two forms give the same output (max |difference| relative to the output's max |value|: float32 within 1e-4, bfloat16
within 3e-2), then times both, their calls interleaved so that a change of load on the machine hits both alike:
median milliseconds of ``--repeats`` calls after a warm-up (compile) call, each waited on. A ``--cases`` entry QxC
is a chunk of Q tokens at context C (Q = C: a first chunk).

``--engine`` times the engine's own attention layer instead (`jaxserve.models.deepseek.MLAttention`, one layer of
DeepSeek-V2-Lite's shape with random weights, its q / kv projections and o_proj included, over a paged latent pool
of block size 16) with ``prefill_form`` "absorbed" (the backend's latent attention: on CPU the native kernel) and
"expanded" (`jaxserve.models.mla_expanded`, plain XLA), after checking that both give the same output.

    python scripts/bench_mla_prefill.py
    python scripts/bench_mla_prefill.py --dtype float32 --repeats 3
    python scripts/bench_mla_prefill.py --heads 16 128 --cases 256x256 512x4096
    python scripts/bench_mla_prefill.py --engine
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from check_targets import DEEPSEEK_V2_LITE  # noqa: E402
from host_cpu import cpu_name  # noqa: E402

from jaxserve.attention.backends import get_attention_backend  # noqa: E402
from jaxserve.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.config.model_config import ModelConfig  # noqa: E402
from jaxserve.models.deepseek import MLAttention  # noqa: E402
from jaxserve.models.rotary import rotary_cos_sin  # noqa: E402

DEFAULT_CASES = ("256x256", "1024x1024", "2048x2048", "512x4096", "512x8192")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |absorbed - expanded| / max |output|


@dataclasses.dataclass(frozen=True)
class MLAShape:
    heads: int
    rank: int = 512  # kv_lora_rank r
    rope: int = 64  # qk_rope_head_dim dr
    nope: int = 128  # qk_nope_head_dim
    v: int = 128  # v_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.nope + self.rope) ** -0.5


def causal_mask(num_q: int, context: int) -> jax.Array:
    """bool[Q, C]: query i, at position C - Q + i, sees the keys at positions <= its own."""
    query_pos = context - num_q + jnp.arange(num_q)[:, None]
    return jnp.arange(context)[None, :] <= query_pos


def softmax_probs(scores: jax.Array, scale: float, dtype) -> jax.Array:
    """Causal softmax in float32 of scores f32[H, Q, C], cast to ``dtype`` for the value product."""
    scores = jnp.where(causal_mask(*scores.shape[1:]), scores * scale, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def split_kv_b_proj(w_kv: jax.Array, shape: MLAShape) -> tuple[jax.Array, jax.Array]:
    """(W_UK [r, H, nope], W_UV [r, H, v]) of kv_b_proj's weight [r, H * (nope + v)]."""
    w = w_kv.reshape(shape.rank, shape.heads, shape.nope + shape.v)
    return w[..., :shape.nope], w[..., shape.nope:]


def f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def absorbed_attention(q_nope, q_pe, rows, w_kv, shape: MLAShape) -> jax.Array:
    """f32[Q, H, v]: multi-query attention of [W_UK^T q_nope | q_pe] over the latent rows, then W_UV."""
    dtype, w_uk, w_uv = rows.dtype, *split_kv_b_proj(w_kv, shape)
    q_lat = f32_einsum("qhd,rhd->qhr", q_nope, w_uk).astype(dtype)
    query = jnp.concatenate([q_lat, q_pe], axis=-1)  # [Q, H, r + dr]
    probs = softmax_probs(f32_einsum("qhe,ce->hqc", query, rows), shape.softmax_scale, dtype)
    # [H, Q, r] then transposed: XLA:CPU has no bf16 x bf16 = f32 dot that writes [Q, H, r] from probs [H, Q, C]
    out_latent = f32_einsum("hqc,cr->hqr", probs, rows[:, :shape.rank]).transpose(1, 0, 2).astype(dtype)
    return f32_einsum("qhr,rhv->qhv", out_latent, w_uv)


def expanded_attention(q_nope, q_pe, rows, w_kv, shape: MLAShape) -> jax.Array:
    """f32[Q, H, v]: the context expanded to per-head keys [W_UK c | k_pe] and values W_UV c, then multi-head
    attention."""
    dtype, w_uk, w_uv = rows.dtype, *split_kv_b_proj(w_kv, shape)
    latent, k_pe = rows[:, :shape.rank], rows[:, shape.rank:]
    k_nope = f32_einsum("cr,rhd->chd", latent, w_uk).astype(dtype)
    values = f32_einsum("cr,rhv->chv", latent, w_uv).astype(dtype)
    k_pe_per_head = jnp.broadcast_to(k_pe[:, None, :], (*k_nope.shape[:2], shape.rope))
    keys = jnp.concatenate([k_nope, k_pe_per_head], axis=-1)  # [C, H, nope + dr]
    query = jnp.concatenate([q_nope, q_pe], axis=-1)  # [Q, H, nope + dr]
    probs = softmax_probs(f32_einsum("qhe,che->hqc", query, keys), shape.softmax_scale, dtype)
    return f32_einsum("hqc,chv->qhv", probs, values)


def absorbed_flops(num_q: int, context: int, s: MLAShape) -> int:
    """Dense multiply-adds x 2: scores and latent output over all Q x C, plus the two per-query projections."""
    attention = num_q * context * s.heads * ((s.rank + s.rope) + s.rank)
    projections = num_q * s.heads * s.rank * (s.nope + s.v)
    return 2 * (attention + projections)


def expanded_flops(num_q: int, context: int, s: MLAShape) -> int:
    """Dense multiply-adds x 2: the expansion of every context row, then scores and values over all Q x C."""
    expansion = context * s.rank * s.heads * (s.nope + s.v)
    attention = num_q * context * s.heads * ((s.nope + s.rope) + s.v)
    return 2 * (expansion + attention)


def random_inputs(num_q: int, context: int, shape: MLAShape, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """(q_nope, q_pe, latent rows, kv_b_proj weight) of unit-scale values, so that the scores are of order one."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q_nope = jax.random.normal(keys[0], (num_q, shape.heads, shape.nope))
    q_pe = jax.random.normal(keys[1], (num_q, shape.heads, shape.rope))
    rows = jax.random.normal(keys[2], (context, shape.rank + shape.rope))  # the latent after RMSNorm: rms 1
    w_kv = jax.random.normal(keys[3], (shape.rank, shape.heads * (shape.nope + shape.v))) * shape.rank**-0.5
    return tuple(x.astype(dtype) for x in (q_nope, q_pe, rows, w_kv))


def relative_difference(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def interleaved_median_ms(fns, args, repeats: int) -> list[float]:
    """Median ms of each fn(*args) over ``repeats`` rounds that call every fn once in turn (compiled beforehand)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            fn_times.append(time.perf_counter() - start)
    return [1e3 * statistics.median(fn_times) for fn_times in times]


def run_case(num_q: int, context: int, shape: MLAShape, dtype: str, repeats: int) -> str:
    """One table row: both forms checked against each other, then timed."""
    args = random_inputs(num_q, context, shape, jnp.dtype(dtype))
    absorbed = jax.jit(lambda *a: absorbed_attention(*a, shape))
    expanded = jax.jit(lambda *a: expanded_attention(*a, shape))
    difference = relative_difference(absorbed(*args), expanded(*args))  # also the warm-up (compile) calls
    assert difference <= TOLERANCE[dtype], f"forms differ at Q={num_q} C={context}: {difference:.2e}"
    absorbed_ms, expanded_ms = interleaved_median_ms([absorbed, expanded], args, repeats)
    flops_a, flops_e = absorbed_flops(num_q, context, shape), expanded_flops(num_q, context, shape)
    return (f"| {shape.heads} | {num_q} | {context} | {absorbed_ms:.1f} | {expanded_ms:.1f} | "
            f"{expanded_ms / absorbed_ms:.2f} | {flops_a / 1e9:.2f} | {flops_e / 1e9:.2f} | {flops_e / flops_a:.2f} | "
            f"{flops_a / absorbed_ms / 1e6:.0f} / {flops_e / expanded_ms / 1e6:.0f} | {difference:.1e} |")


ENGINE_BLOCK_SIZE = 16


def engine_layer(form: str, dtype) -> tuple[MLAttention, ModelConfig]:
    """The engine's attention layer of DeepSeek-V2-Lite's shape attending its prefill steps in ``form``."""
    cfg = ModelConfig.from_hf({**DEEPSEEK_V2_LITE, "num_hidden_layers": 1})
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, prefill_form=form))
    return MLAttention(cfg, dtype, get_attention_backend("auto")), cfg


def engine_inputs(num_q: int, context: int, cfg: ModelConfig, dtype) -> tuple:
    """(hidden states [1, Q, H], pool (latent rows of the context, no V pages), metadata, rotary) of one sequence's
    chunk of Q tokens ending its context of C tokens."""
    keys = jax.random.split(jax.random.key(1), 2)
    pages = -(-context // ENGINE_BLOCK_SIZE)
    rows = jax.random.normal(keys[0], (1, 1, pages, ENGINE_BLOCK_SIZE, cfg.head_dim)).astype(dtype)
    pool = (rows, jnp.zeros((1, 1, pages, ENGINE_BLOCK_SIZE, 0), dtype))
    meta = AttentionMetadata(block_tables=jnp.arange(pages, dtype=jnp.int32)[None],
                             q_start=jnp.asarray([context - num_q], jnp.int32),
                             lengths=jnp.asarray([context], jnp.int32))
    positions = context - num_q + jnp.arange(num_q, dtype=jnp.int32)[None]
    rotary = rotary_cos_sin(positions, cfg.rope, cfg.mla.qk_rope_head_dim)
    hidden = jax.random.normal(keys[1], (1, num_q, cfg.hidden_size)).astype(dtype)
    return hidden, pool, meta, rotary


def run_engine_case(num_q: int, context: int, dtype: str, repeats: int) -> str:
    """One table row of ``--engine``: the layer's prefill step in both forms, checked against each other, timed."""
    dtype = jnp.dtype(dtype)
    steps = []
    for form in ("absorbed", "expanded"):
        layer, cfg = engine_layer(form, dtype)
        hidden, pool, meta, rotary = engine_inputs(num_q, context, cfg, dtype)
        params = layer.init(jax.random.key(0), hidden, pool, jnp.int32(0), meta, rotary)
        steps.append(jax.jit(lambda h, p, layer=layer, meta=meta, rotary=rotary, params=params:
                             layer.apply(params, h, p, jnp.int32(0), meta, rotary)[0]))
    args = (hidden, pool)
    difference = relative_difference(steps[0](*args), steps[1](*args))
    assert difference <= TOLERANCE[dtype.name], f"forms differ at Q={num_q} C={context}: {difference:.2e}"
    absorbed_ms, expanded_ms = interleaved_median_ms(steps, args, repeats)
    return (f"| {num_q} | {context} | {absorbed_ms:.1f} | {expanded_ms:.1f} | {expanded_ms / absorbed_ms:.2f} | "
            f"{difference:.1e} |")


def parse_case(text: str) -> tuple[int, int]:
    num_q, context = (int(part) for part in text.lower().split("x"))
    if not 0 < num_q <= context:
        raise argparse.ArgumentTypeError(f"{text}: need 0 < Q <= C")
    return num_q, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[16], help="16: V2-Lite, 128: V3")
    parser.add_argument("--cases", type=parse_case, nargs="+", default=[parse_case(c) for c in DEFAULT_CASES],
                        metavar="QxC", help="chunks of Q tokens at context C (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCE))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="time the engine's attention layer (V2-Lite's shape)")
    args = parser.parse_args()
    if args.engine:
        engine_table(args)
        return
    print(f"MLA prefill, one layer, {args.dtype}, dense causal attention; jax {jax.__version__} on "
          f"{jax.default_backend()}: {cpu_name()}")
    print("r 512, rope 64, nope 128, v 128; ms: median of", args.repeats, "calls; GFLOP: dense, multiply-add = 2")
    print("| heads | Q | C | absorbed (ms) | expanded (ms) | expanded / absorbed | absorbed GFLOP | "
          "expanded GFLOP | FLOP expanded / absorbed | GFLOP/s abs / exp | max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for heads in args.heads:
        for num_q, context in args.cases:
            print(run_case(num_q, context, MLAShape(heads), args.dtype, args.repeats), flush=True)


def engine_table(args) -> None:
    print(f"The engine's MLA layer (DeepSeek-V2-Lite's shape, {args.dtype}), one sequence's prefill step; jax "
          f"{jax.__version__} on {jax.default_backend()}: {cpu_name()}; ms: median of {args.repeats} calls")
    print("| Q | C | absorbed (ms) | expanded (ms) | expanded / absorbed | max rel diff |")
    print("|---|---|---|---|---|---|")
    for num_q, context in args.cases:
        print(run_engine_case(num_q, context, args.dtype, args.repeats), flush=True)


if __name__ == "__main__":
    main()
