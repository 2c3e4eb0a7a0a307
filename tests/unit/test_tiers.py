"""Tiers as objects: placement rules, where gradients wait, byte accounting, and the one chunker (no process group)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import BackwardCopies, GradShard, SplitGradients, StepTimeCopies, SwappedGradients
from zeroshard.offload.residency import InMemory
from zeroshard.offload.tier import HostTier, NvmeTier, PartialOffload, Tier, tier_for
from zeroshard.utils.chunks import greedy_chunks

CPU = torch.device("cpu")


class _FakeStore(InMemory):
    """Records what a swapping store was asked to do."""

    leaves_memory = True

    resident_bytes = 7  # type: ignore[assignment]
    disk_bytes = 100  # type: ignore[assignment]

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def place(self, key: str, tensors: object) -> None:
        self.calls.append(("place", key))

    def evict(self, key: str, tensors: object = ()) -> None:
        self.calls.append(("evict", key))

    def settle(self, key: str) -> None:
        self.calls.append(("settle", key))


def _nvme() -> NvmeTier:
    return NvmeTier(_FakeStore)  # type: ignore[arg-type]


def test_tier_for_maps_the_config_devices():
    assert type(tier_for("none", CPU, True)) is Tier
    assert type(tier_for("cpu", CPU, True)) is HostTier
    assert type(tier_for("nvme", CPU, True, _FakeStore)) is NvmeTier  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        tier_for("nvme", CPU, True)


@pytest.mark.parametrize(
    ("master", "param", "shared"),
    [
        ("device", "device", True),
        ("cpu", "cpu", True),
        ("nvme", "nvme", True),
        ("cpu", "device", False),  # a master moved off the device never serves a shard that stays there
        ("cpu", "nvme", False),  # a shard that leaves memory only aliases a master that goes too
        ("nvme", "cpu", True),
        ("device", "cpu", True),  # on a CPU machine both live in host memory
    ],
)
def test_master_and_compute_shard_share_one_tensor_when_tiers_allow(master: str, param: str, shared: bool):
    tiers = {"device": lambda: Tier(CPU), "cpu": lambda: HostTier(), "nvme": _nvme}
    assert tiers[master]().shares_shard_with(tiers[param]()) is shared


def test_only_the_device_tier_lets_a_master_alias_the_parameter_buffer():
    assert Tier(CPU).may_alias_compute() and not HostTier().may_alias_compute() and not _nvme().may_alias_compute()


def test_each_tier_counts_its_bytes_in_its_own_columns():
    device, host, nvme = StrategyMemory(), StrategyMemory(), StrategyMemory()
    for tier, memory in ((Tier(CPU), device), (HostTier(), host), (_nvme(), nvme)):
        tier.count_state(memory, masters=40, state=80)
        tier.count_grad_copies(memory, 16)
    assert (device.master_weights, device.optimizer_state, device.comm_buffers) == (40, 80, 16)
    assert (host.host_master_weights, host.host_optimizer_state, host.host_gradients) == (40, 80, 16)
    assert host.master_weights == host.optimizer_state == 0
    # NVMe: what is resident now (read in for a step) and what is in the swap files
    assert (nvme.host_optimizer_state, nvme.nvme_bytes, nvme.master_weights) == (7, 100, 0)


def test_gradient_tiers_follow_the_master_tier():
    assert type(Tier(CPU).gradients(None, False)) is StepTimeCopies
    assert type(HostTier().gradients(None, False)) is BackwardCopies
    assert type(_nvme().gradients(None, False)) is SwappedGradients


def test_partial_offload_puts_the_last_ratio_of_the_sub_groups_on_the_host():
    """DeepSpeed's rule (stage3.py, `subgroup_to_device`): sub-group i of n goes to the CPU if
    i >= int((1 - ratio) * n); whole sub-groups, so one sub-group with any ratio > 0 is offloaded."""
    tier = tier_for("cpu", CPU, False, ratio=0.3)
    assert isinstance(tier, PartialOffload) and type(tier_for("cpu", CPU, False, ratio=1.0)) is HostTier

    def on_host(count: int) -> list[bool]:
        return [tier.for_sub_group(k, count) is tier.host_tier for k in range(count)]

    assert on_host(10) == [False] * 7 + [True] * 3
    assert on_host(3) == [False, False, True] and on_host(1) == [True]
    assert not any(tier_for("cpu", CPU, False, ratio=0.0).for_sub_group(k, 4).offloaded for k in range(4))
    assert HostTier().for_sub_group(0, 4).offloaded and not Tier(CPU).for_sub_group(3, 4).offloaded
    with pytest.raises(AssertionError, match="each sub-group's tier counts"):
        tier.count_state(StrategyMemory(), 1, 2)


def test_partial_offload_logs_the_split_it_made(log: pytest.LogCaptureFixture):
    tier = tier_for("cpu", CPU, False, ratio=0.5)
    assert isinstance(tier, PartialOffload)
    tier.log_split([(tier.device_tier, 900), (tier.host_tier, 100)])
    Tier(CPU).log_split([(Tier(CPU), 1000)])  # nothing split, nothing said
    assert [r.getMessage() for r in log.records if r.name == "zeroshard.offload.tier"] == [
        "stage 3, offload_optimizer.ratio 0.5: 1 of 2 sub-groups (10% of this rank's shard elements) keep their "
        "optimizer state in host memory, the others on cpu (sub_group_size sets the granularity)"
    ]


def test_partial_offload_gradients_follow_each_shards_sub_group():
    tier = tier_for("cpu", CPU, False, ratio=0.5)
    assert isinstance(tier, PartialOffload)
    grads = tier.gradients(None, False)
    assert isinstance(grads, SplitGradients)
    host, device = grads.part_for("grad/1", tier.host_tier), grads.part_for("grad/0", tier.device_tier)
    assert type(host) is BackwardCopies and type(device) is StepTimeCopies
    master, bf16 = torch.zeros(4), torch.full((4,), 3.0, dtype=torch.bfloat16)
    assert device.copy_for(bf16, master) is None  # a temporary at the step
    copy = host.copy_for(bf16, master)
    assert copy is not None and copy.dtype == torch.float32
    # the host copy is made when the shard is final on the boundary; the device shard waits for the step
    assert grads.received(GradShard("grad/1", bf16), copy, boundary=True) and copy[0] == 3.0
    assert not grads.received(GradShard("grad/0", bf16), None, boundary=True)
    memory = StrategyMemory()
    grads.count(memory, 16)
    assert memory.host_gradients == 16 and memory.comm_buffers == 0


def test_the_optimizer_reads_an_fp32_shard_in_place_and_copies_others():
    master = torch.zeros(4)
    fp32 = torch.full((4,), 2.0)
    for tier in (Tier(CPU), HostTier(), _nvme()):
        grads = tier.gradients(None, False)
        assert grads.copy_for(fp32, master) is fp32
        assert grads.for_step(fp32, master, fp32, False, 0.5) is fp32 and fp32[0] == 1.0
        fp32.fill_(2.0)
    bf16 = torch.full((4,), 2.0, dtype=torch.bfloat16)
    assert Tier(CPU).gradients(None, False).copy_for(bf16, master) is None  # a temporary at the step
    temp = StepTimeCopies.for_step(bf16, master, None, False, 0.5)
    assert temp.dtype == torch.float32 and temp[0] == 1.0 and bf16[0] == 2.0


def test_host_copies_are_refreshed_in_backward_on_the_boundary_only():
    grads = HostTier().gradients(None, False)
    shard = torch.full((4,), 3.0, dtype=torch.bfloat16)
    copy = grads.copy_for(shard, torch.zeros(4))
    assert copy is not None and copy.dtype == torch.float32 and copy is not shard
    assert not grads.received(GradShard("g", shard), copy, boundary=False) and copy[0] == 0.0
    assert grads.received(GradShard("g", shard), copy, boundary=True) and copy[0] == 3.0
    shard.fill_(5.0)  # not refreshed in backward: the step copies it itself
    assert grads.for_step(shard, torch.zeros(4), copy, False, 1.0)[0] == 5.0


def test_swapped_gradients_record_the_norm_before_writing_and_bound_pending_writes():
    tier = _nvme()
    grads = tier.gradients(None, True)
    store = tier.residency
    shards = [GradShard(f"grad/{i}", torch.full((4,), float(i + 1))) for i in range(4)]
    for slot in shards:
        grads.place(slot)
    shards[1].shard[0] = float("inf")
    for slot in shards:
        grads.received(slot, None, boundary=True)
    grads.finish_backward()
    assert store.calls[:4] == [("place", s.key) for s in shards]
    evicts = [c for c in store.calls if c[0] == "evict"]
    settles = [c for c in store.calls if c[0] == "settle"]
    assert len(evicts) == len(settles) == 4  # at most MAX_PENDING_WRITES unsettled at any time
    assert store.calls.index(("settle", "grad/0")) < store.calls.index(("evict", "grad/3"))
    norms, overflow = grads.norms(shards, prepare=lambda: None)  # from the records: nothing is read back
    assert overflow and len(norms) == 4 and float(norms[0]) == 2.0
    grads.reset()
    unplaced = tier.gradients(None, False)  # stages 1-2: gradients stay in memory, norms from the shards
    assert float(unplaced.norms([GradShard("group0", torch.full((4,), 1.0))], lambda: None)[0][0]) == 2.0


def test_one_greedy_chunker_for_buckets_sub_groups_and_shards():
    sizes = [4, 4, 9, 1, 1]
    assert greedy_chunks(sizes, 8, "before") == [[0, 1], [2], [3, 4]]  # a chunk passes the limit only alone
    assert greedy_chunks(sizes, 5, "after") == [[0, 1], [2], [3, 4]]  # DeepSpeed's sub-groups close at the limit
    assert greedy_chunks(sizes, 8, "before", oversize_alone=True) == [[2], [0, 1], [3, 4]]
    assert greedy_chunks([], 8, "after") == []


@pytest.mark.parametrize("split", [False, True])
def test_a_released_shard_counts_by_its_boundary_record(split):
    """[Note: a gradient shard leaves once its host copy holds it]: the norm and the inf/nan verdict of a shard whose
    memory went after its host copy come from what `let_go` recorded, bit for bit what the shard gave, in slot order
    with the shards still held; nothing is read back (`prepare` is not called)."""
    tier = tier_for("cpu", CPU, False, ratio=0.5) if split else HostTier()
    grads = tier.gradients(None, check_overflow=True)
    if split:
        assert isinstance(tier, PartialOffload)
        grads.part_for("grad/0", tier.device_tier)
        grads.part_for("grad/1", tier.host_tier)
    values = torch.tensor([3.0, -4.0, 1.5], dtype=torch.bfloat16)
    for poison, expect_overflow in ((None, False), (float("inf"), True), (float("nan"), True)):
        held = GradShard("grad/0", torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
        gone = GradShard("grad/1", values.clone())
        if poison is not None:
            gone.shard[1] = poison
        expected = [torch.linalg.vector_norm(s.shard, dtype=torch.float32) for s in (held, gone)]
        grads.let_go(gone)
        gone.shard.untyped_storage().resize_(0)
        norms, overflow = grads.norms([held, gone], prepare=lambda: pytest.fail("read back"))
        assert overflow is expect_overflow, poison
        assert len(norms) == 2 and torch.equal(norms[0], expected[0])
        assert torch.equal(norms[1], expected[1]) or (poison is not None and not norms[1].isfinite())
        grads.reset()
    # a released shard without a record (none was taken: a backward outside the engine's accounting) is read back
    gone = GradShard("grad/1", values.clone())
    gone.shard.untyped_storage().resize_(0)
    asked = []
    grads.norms([gone], prepare=lambda: asked.append(gone.shard.untyped_storage().resize_(6)))
    assert asked
