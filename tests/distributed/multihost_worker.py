"""One process of a two-process (multi-host) engine run on 127.0.0.1, started by tests/distributed/test_multihost.py.

    python -m tests.distributed.multihost_worker MODEL_DIR ORBAX_DIR BUCKETS OUT_JSON

The distributed settings come from the environment (JAXSERVE_DISTRIBUTED_INIT, JAXSERVE_COORDINATOR_ADDRESS,
JAXSERVE_NUM_PROCESSES, JAXSERVE_PROCESS_ID) and XLA_FLAGS gives each process 2 CPU devices, so the engine's
mesh has 4 devices over 2 processes. Writes the greedy tokens and what this process holds to OUT_JSON, and
whether restoring ORBAX_DIR (the same model converted) onto the engine's mesh gives this process exactly
the shards the engine placed from the Hugging Face directory.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [list(range(3, 40)), [1, 17, 200, 3, 99, 45, 45, 8], [250, 11, 64, 7, 31]]
MAX_TOKENS = 16


def orbax_shards_match(orbax_dir: str, engine_params, mesh) -> bool:
    import jax
    import numpy as np

    from jaxserve.weights import load_model

    restored = load_model(orbax_dir, mesh=mesh).params
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(engine_params), strict=True):
        if got.sharding != expected.sharding:
            return False
        for a, b in zip(got.addressable_shards, expected.addressable_shards, strict=True):
            if a.index != b.index or not np.array_equal(np.asarray(a.data), np.asarray(b.data)):
                return False
    return True


def main(model_dir: str, orbax_dir: str, buckets: str, out_json: str) -> None:
    import jax

    from jaxserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", buckets=buckets, max_model_len=128, tensor_parallel_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    pool = llm.llm_engine.runner.kv_pool[0]
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "pool_devices": len(pool.sharding.device_set),
        "pool_local_shard_bytes": [s.data.nbytes for s in pool.addressable_shards],
        "pool_bytes": pool.nbytes,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "orbax_shards_match": orbax_shards_match(orbax_dir, llm.llm_engine.runner.params, llm.llm_engine.mesh),
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
