"""What to compile and where it is kept: the bucket grid and KV pool an engine runs on, warm-up, the persistent
compile cache and its serialized executables, precompilation, deviceless TPU/GPU targets, bucket planning."""
