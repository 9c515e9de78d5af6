"""Tensor parallelism: the device mesh and where every array of the step lives on it.

Place in the data flow: the engine builds a one-axis mesh ("tp") over `tensor_parallel_size` devices
(all hosts' devices after `jaxserve.distributed.multihost.initialize`); the weight loaders restore (orbax) or place
(safetensors, GGUF) every parameter with `param_shardings`, and the model runner allocates the KV pool
with `kv_pool_sharding` and compiles its steps with these shardings as in- and out-shardings.

Megatron-style split: q/k/v, gate and up projections are column-parallel (output features sharded, so
each device holds whole attention heads and a slice of the MLP's hidden dimension); o and down
projections are row-parallel (input features sharded; XLA sums the partial products across devices).
The KV pool `[L, Hkv, blocks, block_size, D]` is sharded on its kv-head axis (MLA's pool of latents, one kv head,
is whole on every device: each attends for its query heads). Embeddings, norms and the
LM head are replicated. Every head count must divide by the mesh size: kv heads are not replicated, so
a GQA model with fewer kv heads than devices is refused with an error naming both numbers.

Mixture-of-experts blocks (`jaxserve.models.moe`) are expert-parallel: the stacked experts' weights
(module "experts": gate_proj, up_proj `[..., E, hidden, I]`, down_proj `[..., E, I, hidden]`) are sharded on
their expert axis, E / tp whole experts per device; the router is replicated, and Qwen2-MoE's shared expert
splits like a dense MLP by the rules above. The number of experts must divide by the mesh size.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config.model_config import ModelConfig

TP_AXIS = "tp"
# (q_b_proj and kv_b_proj: MLA's per-head projections, out of and into the latent)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
EXPERTS = "experts"  # the MoE block's stacked experts: these leaves are sharded on their expert axis
EXPERT_PARALLEL = ("gate_proj", "up_proj", "down_proj")
# a row-parallel layer's leaves split on their input axis: the kernel, and a grouped kernel's scales and offsets
ROW_SPLIT_LEAVES = ("kernel", "group_scale", "group_offset")


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A one-axis mesh over the first `tensor_parallel_size` devices (of every process)."""
    devices = jax.devices() if devices is None else devices
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) exceeds the {len(devices)} available "
            f"{devices[0].platform} devices"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def engine_mesh(tensor_parallel_size: int, data_parallel_rank: int = 0) -> Mesh:
    """The engine's mesh: devices [rank x tp, (rank + 1) x tp) (a data-parallel replica takes its own group).
    Across processes (multi-host) it must span every device of every host, so that each process holds a part
    of it: tensor_parallel_size must equal the global device count there."""
    if jax.process_count() > 1 and tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"with {jax.process_count()} processes, tensor_parallel_size ({tensor_parallel_size}) must equal the "
            f"global device count ({jax.device_count()}): one engine spans every host's devices"
        )
    devices = jax.devices()
    first = data_parallel_rank * tensor_parallel_size
    if data_parallel_rank and first + tensor_parallel_size > len(devices):  # rank 0: make_mesh says what is missing
        raise ValueError(
            f"data-parallel replica {data_parallel_rank} needs devices {first} to {first + tensor_parallel_size - 1} "
            f"(tensor_parallel_size {tensor_parallel_size} each), but this host has {len(devices)} "
            f"{devices[0].platform} devices"
        )
    return make_mesh(tensor_parallel_size, devices[first:])


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Clear errors for a model the mesh cannot split evenly (heads, kv heads, MLP hidden dimension, and
    for mixture-of-experts models the experts and the shared expert's hidden dimension)."""
    if config.mla is not None:  # the latent pool is whole on every device: the query heads split
        _check_latent_parallel(config, tensor_parallel_size)
        return
    if config.gemma4 is not None and tensor_parallel_size > 1:
        raise ValueError("Gemma 4 is served on one device per replica (tensor_parallel_size 1) for now: its layers' "
                         "attention shapes differ, and the mesh rules split one shape")
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
    if config.num_experts is None or config.mixes_mlp_kinds:  # experts are split whole, dense MLPs by columns
        sizes["intermediate_size"] = config.intermediate_size
    if config.num_experts is not None:
        sizes["num_experts"] = config.num_experts
    if config.shared_expert_intermediate_size is not None:
        sizes["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    group = config.quantization.group_size if config.quantization else None
    if group:  # row-parallel layers split their group scales with their inputs
        sizes[f"groups of {group} inputs of o_proj"] = config.num_heads * config.head_dim // group
        sizes[f"groups of {group} inputs of down_proj"] = config.intermediate_size // group
    check_divisible(sizes, tensor_parallel_size)


def _check_latent_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """MLA models: heads (q_b_proj, kv_b_proj by head), the dense MLPs' and the shared experts' hidden dimensions,
    and the routed experts (whole per device) split over the mesh."""
    sizes = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size}
    if config.num_experts is not None:
        sizes["num_experts"] = config.num_experts
        sizes["shared experts' intermediate size"] = config.moe_intermediate_size * config.mla.n_shared_experts
    check_divisible(sizes, tensor_parallel_size)


def check_divisible(sizes: dict[str, int], tensor_parallel_size: int) -> None:
    """A ValueError naming the first of the model's `sizes` that the mesh size does not divide."""
    for name, size in sizes.items():
        if size % tensor_parallel_size:
            raise ValueError(
                f"the model's {name} ({size}) is not divisible by tensor_parallel_size ({tensor_parallel_size}); "
                f"choose a tensor_parallel_size that divides it"
            )


def param_spec(path: tuple[str, ...], ndim: int) -> P:
    """The partition of one parameter from its tree path, e.g. ("params", "layers", "mlp", "up_proj",
    "kernel"); kernels are `[..., in, out]` (stacked layers add a leading axis), biases and a quantized kernel's
    scales (`kernel_scale`) `[..., out]`, a grouped kernel's `group_scale` / `group_offset` `[..., in / group, out]`
    (split as the kernel is), the MoE experts' weights `[..., E, in, out]`."""
    module, leaf = path[-2], path[-1]
    if module == EXPERTS and leaf in EXPERT_PARALLEL:
        return P(*([None] * (ndim - 3)), TP_AXIS, None, None)
    # quantized experts' scales and gpt-oss's experts' biases, [..., E, out]
    if module == EXPERTS and leaf.removesuffix("_scale").removesuffix("_bias") in EXPERT_PARALLEL:
        return P(*([None] * (ndim - 2)), TP_AXIS, None)
    if leaf == "sinks":  # gpt-oss's attention sinks [..., Hq]: with their heads
        return P(*([None] * (ndim - 1)), TP_AXIS)
    if module in COLUMN_PARALLEL:
        return P(*([None] * (ndim - 1)), TP_AXIS)
    if module in ROW_PARALLEL and leaf in ROW_SPLIT_LEAVES:
        return P(*([None] * (ndim - 2)), TP_AXIS, None)
    return P()


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(key, "key", key)) for key in path)


def param_shardings(params, mesh: Mesh):
    """A NamedSharding per leaf of a parameter tree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_path_names(path), len(x.shape))), params
    )


def kv_pool_sharding(mesh: Mesh, latent: bool = False) -> NamedSharding:
    """The KV pool `[L, Hkv, blocks, block_size, D]`: each device holds its kv heads' pages; a pool of latents
    (MLA's one kv head, `ModelConfig.kv_values_in_keys`) is whole on every device, which attends for its heads."""
    return NamedSharding(mesh, P() if latent else P(None, TP_AXIS))


def hidden_sharding(mesh: Mesh, hidden_size: int) -> NamedSharding:
    """Hidden states kept between programs `[N, H]` (the prompt logprobs' positions): each device holds a slice of
    H where it divides, else all of it."""
    return NamedSharding(mesh, P(None, TP_AXIS) if hidden_size % mesh.size == 0 else P())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(params, mesh: Mesh):
    """Places a parameter tree (numpy or jax arrays) on the mesh; already placed arrays are not copied."""
    return jax.device_put(params, param_shardings(params, mesh))


def per_device_bytes(params, mesh: Mesh) -> int:
    """Bytes of one device's shards of a parameter tree placed with `param_shardings` (the largest shard)."""
    shardings = param_shardings(params, mesh)
    return sum(
        int(np.prod(sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
        for x, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
    )
