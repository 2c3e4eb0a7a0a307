"""`deepspeed.runtime.comm`: the batched collectives scripts call (`coalesced_collectives`)."""
