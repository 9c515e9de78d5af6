"""Everything traced into an executable: the ModelRunner (device state, one compiled executable per bucket
shape), the step inputs built from a Schedule, the sampler and its per-sequence slot state, logprobs."""
