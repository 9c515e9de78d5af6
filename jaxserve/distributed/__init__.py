"""Meshes and hosts: the device mesh and how weights and the KV pool are split over it (tensor parallelism),
and the multi-host start-up (`jax.distributed`)."""
