"""`deepspeed.runtime.sequence_parallel`: the sequence-parallel mpu (parallel_state_sp)."""
