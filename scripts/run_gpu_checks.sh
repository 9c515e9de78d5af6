#!/usr/bin/env bash
# The GPU checks and figures of docs/benchmarks/gpu.md in one run, on a machine with one NVIDIA GPU:
# a Llama-3.2-1B-shaped random model (bfloat16): its decode step against the memory roofline, the engine against
# transformers on the same GPU (and with async scheduling off), the engine's tokens with the Triton kernels on a
# tiny model, traces of its steps summed by kernel (`profile_gpu_steps.py`), where the shared workload's time goes
# step by step (`profile_steps.py`), and the three Triton kernels against the XLA reference (`bench_kernels.py`).
# The first part compiles the grid into the compile cache the later ones read. Each part has a time limit and its
# own log under $OUT; a part that fails does not stop the others. PARTS names the parts to run (default: all).
#
#     OUT=/tmp/gpu WORKLOAD=../shared/workloads/mixed_lengths.jsonl bash scripts/run_gpu_checks.sh
#     PARTS="model roofline throughput" OUT=/tmp/gpu bash scripts/run_gpu_checks.sh
set -u
OUT=${OUT:-/tmp/gpu-checks}
WORKLOAD=${WORKLOAD:-../shared/workloads/mixed_lengths.jsonl}
MODEL=${MODEL:-/tmp/llama-3.2-1b-random}
PARTS=${PARTS:-model roofline throughput engine steps workload kernels}
GRID=scripts/gpu_bench_buckets.toml
KV_BLOCKS=32768  # 16-token blocks: 17 GB of bfloat16 K/V for this model (32 KB a token), the same pool in every run
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a limit, its output in $OUT/NAME.log, if PARTS names it
    local name=$1 limit=$2
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start))s"
    grep -v "Processed prompts\|^INFO\|^WARNING\|^| [a-z]* | \`\|^kinds\|^modules\|^|---" "$OUT/$name.log" \
        | tail -${TAIL:-30}
}

nvidia-smi -L
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, \
'transformers', transformers.__version__)"
part model 60 python3 scripts/make_random_model.py llama-3.2-1b "$MODEL"
part roofline 150 python3 scripts/bench_decode_roofline.py --model "$MODEL" --buckets "$GRID" \
    --num-kv-blocks $KV_BLOCKS --max-model-len 2048 --batches 16,64,256 --cached 1023
part throughput 170 python3 scripts/bench_throughput.py --model "$MODEL" --dtype bfloat16 --buckets "$GRID" \
    --num-kv-blocks $KV_BLOCKS --workload "$WORKLOAD" --max-model-len 2048 --async-scheduling off \
    --hf-dtype bfloat16 --hf-device cuda --hf-batch-sizes 256
part engine 100 python3 scripts/check_gpu_engine.py
part steps 90 python3 scripts/profile_gpu_steps.py --model "$MODEL" --buckets "$GRID" --num-kv-blocks $KV_BLOCKS \
    --batches 16,64,256 --mixed-decode-rows 16,64 --json "$OUT/steps.json" --archive "$OUT/traces.tar.gz"
part workload 50 python3 scripts/profile_steps.py --model "$MODEL" --buckets "$GRID" --num-kv-blocks $KV_BLOCKS \
    --workload "$WORKLOAD" --num-requests 256 --dtype bfloat16
part kernels 140 python3 scripts/bench_kernels.py --dtype bfloat16,float32 --batches 64,256 --contexts 1024,8192 \
    --prefill-batches 1,16 --iters 10
[[ " $PARTS " == *" steps "* ]] && grep "^### " "$OUT/steps.log"
exit 0
