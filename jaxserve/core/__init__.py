"""Host-side scheduling and KV bookkeeping: sequences, the scheduler and the Schedule it hands on, the block
manager and its prefix cache, the bucket grid the scheduler picks steps from. Plain Python and numpy, no JAX
(tests/test_architecture.py checks that it imports without JAX)."""
