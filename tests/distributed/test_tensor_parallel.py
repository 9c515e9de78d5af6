"""Tensor parallelism on 8 virtual CPU devices: runs tests/distributed/check_tensor_parallel.py in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the flag must be set before JAX
starts; this process keeps its single device) and requires every one of its tests to pass.

What the checks cover: tensor_parallel_size 1, 2 and 4 give identical greedy tokens and logits within 2e-5 on a
tiny 8-head GQA Llama, and identical n > 1 samples, penalties, logit_bias, beams, prefix cache hits and prompt
logprobs (their positions split over the hidden axis); the KV pool's per-device bytes shrink by the mesh size;
weights are split column- and row-parallel; executables keep their warm-up shardings and nothing compiles while
serving; the compiled steps communicate only the two row-parallel all-reduces per layer and update the pool and the
sampler state in place; the Pallas kernels work per device (tp 2); GPT-2 under tp 4 (OPT's layer is the same),
Qwen3-MoE (experts split across devices) and Gemma 3 under tp 4 and gpt-oss, DeepSeek-V3 (its latent pool whole on
every device) and Qwen3-Next (its gated q_proj split with the heads) under tp 2 equal transformers' tokens; an
orbax checkpoint restores straight into the mesh sharding; the CPU bfloat16 layout (unrolled layers, uint16 KV
storage) gives tp 1's tokens under tp 2; a GGUF served as int8 blocks (quantization="gguf") splits its group scales
with the row-parallel inputs and equals transformers' tokens under tp 2; clear errors for indivisible heads, too
few kv heads and too many devices.
"""

from __future__ import annotations

from tests.paths import REPO_ROOT, assert_checks_pass_on_cpu_devices

CHECKS = REPO_ROOT / "tests" / "distributed" / "check_tensor_parallel.py"
NUM_CHECKS = 22


def test_tensor_parallel_checks_pass_on_8_cpu_devices():
    assert_checks_pass_on_cpu_devices(CHECKS, 8, NUM_CHECKS, timeout=1500)
