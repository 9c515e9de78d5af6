"""Attention over the paged KV pool, the layer every model calls: the step's batch metadata, the pool's
layout and K/V writes, and the backends (plain-XLA reference, Pallas kernels, the native CPU kernel)."""
