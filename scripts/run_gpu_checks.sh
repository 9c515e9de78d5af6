#!/usr/bin/env bash
# The GPU checks and figures of docs/benchmarks/gpu.md in one run, on a machine with one NVIDIA GPU:
# a Llama-3.2-1B-shaped random model (bfloat16) through the engine against transformers on the same GPU,
# its decode step against the memory roofline, and the three Triton kernels (compiled for real, checked
# against the XLA reference, timed) at decode batch 64 and 256, context 1k and 8k, both pool dtypes.
# Each part has a time limit and its own log under $OUT; a part that fails does not stop the others.
#
#     OUT=/tmp/gpu WORKLOAD=../shared/workloads/mixed_lengths.jsonl bash scripts/run_gpu_checks.sh
set -u
OUT=${OUT:-/tmp/gpu-checks}
WORKLOAD=${WORKLOAD:-../shared/workloads/mixed_lengths.jsonl}
MODEL=${MODEL:-/tmp/llama-3.2-1b-random}
GRID=scripts/gpu_bench_buckets.toml
KV_BLOCKS=32768  # 16-token blocks: 17 GB of bfloat16 K/V for this model (32 KB a token), the same pool in both engine runs
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start))s"
    grep -v "Processed prompts\|^INFO\|^WARNING" "$OUT/$name.log" | tail -${TAIL:-30}
}

nvidia-smi -L
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, \
'transformers', transformers.__version__)"
part model 90 python3 scripts/make_random_model.py llama-3.2-1b "$MODEL"
part throughput 230 python3 scripts/bench_throughput.py --model "$MODEL" --dtype bfloat16 --buckets "$GRID" \
    --num-kv-blocks $KV_BLOCKS --workload "$WORKLOAD" --max-model-len 2048 \
    --hf-dtype bfloat16 --hf-device cuda --hf-batch-sizes 256,64
part roofline 90 python3 scripts/bench_decode_roofline.py --model "$MODEL" --buckets "$GRID" \
    --num-kv-blocks $KV_BLOCKS --max-model-len 2048 --batches 16,64,256 --cached 1023
part kernels 140 python3 scripts/bench_kernels.py --dtype bfloat16,float32 --batches 64,256 --contexts 1024,8192 \
    --prefill-batches 1,16 --iters 10
