"""Turning ZeRO++ on for a stage-3 strategy: the groups, and the gathers and reduce-scatter it swaps in."""

from __future__ import annotations

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.stage3.reduce import UnitReducer
from zeroshard.zero.stage3.schedule import GatherSchedule
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.zeropp.grads import QuantizedReduceScatter
from zeroshard.zero.zeropp.policy import ZeroPPPolicy, build_groups
from zeroshard.zero.zeropp.weights import UnitGathers


def attach_zeropp(
    policy: ZeroPPPolicy | None,
    comm: Collectives,
    units: list[ShardedUnit],
    schedule: GatherSchedule,
    reducer: UnitReducer,
) -> UnitGathers | None:
    """None when ZeRO++ is off (or there is one rank: nothing is communicated); the forward/backward gathers
    otherwise (the schedule's, when qwZ or hpZ is on; the reducer's reduce-scatter is qgZ's when it is on)."""
    if policy is None or not policy.enabled or comm.world_size == 1:
        return None
    groups = build_groups(comm, policy)
    gathers = UnitGathers(policy, comm, groups, units)
    if policy.quantized_weights or policy.hpz:
        schedule.zeropp = gathers
    if policy.quantized_gradients:
        reducer.scatter = QuantizedReduceScatter(groups, policy.quantizer)
    return gathers
