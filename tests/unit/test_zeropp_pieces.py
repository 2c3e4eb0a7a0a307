"""ZeRO++ pieces without a process group: block quantization, the node layout, per-scope counters, the config."""

from __future__ import annotations

import pytest
import torch

from helpers.config_checks import log, warnings_of  # noqa: F401 - `log` is a fixture
from zeroshard.comm.collectives import CollectiveKind, CommStats, Scope
from zeroshard.comm.topology import NodeLayout
from zeroshard.config import parse_config
from zeroshard.zero.quant import BlockQuantizer


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step_per_block(symmetric: bool, dtype: torch.dtype) -> None:
    quantizer = BlockQuantizer(block_size=64, symmetric=symmetric)
    x = (torch.randn(1000) * torch.linspace(0.01, 10, 1000)).to(dtype)  # blocks of very different ranges
    y = quantizer.round_trip(x)
    assert y.dtype == dtype and y.shape == x.shape
    count, length = quantizer.blocks(x.numel())
    padded = torch.zeros(count * length)
    padded[: x.numel()] = x.float()
    blocks = padded.view(count, length)
    if symmetric:
        step = blocks.abs().amax(dim=1) / 127
    else:
        step = (blocks.amax(dim=1) - blocks.amin(dim=1)) / 255
    bound = (step / 2).repeat_interleave(length)[: x.numel()]
    slack = 1e-6 if dtype == torch.float32 else 2**-7 * x.float().abs()  # bf16 rounds the result again
    assert torch.all((y.float() - x.float()).abs() <= bound * 1.0001 + slack)


def test_zeros_and_sizes() -> None:
    quantizer = BlockQuantizer()  # 256 elements, symmetric: 4 bytes of scale per block
    assert quantizer.round_trip(torch.zeros(10)).tolist() == [0.0] * 10
    assert quantizer.blocks(100) == (1, 100)  # a small chunk is one short block, not a padded 256
    assert quantizer.blocks(1000) == (4, 250)
    assert quantizer.packed_bytes(1000) == 4 * 4 + 1000
    assert quantizer.packed_bytes(1001) % 4 == 0
    assert BlockQuantizer(symmetric=False).packed_bytes(1000) == 8 * 4 + 1000
    assert torch.isnan(quantizer.round_trip(torch.tensor([1.0, float("inf")]))).all()  # an overflow stays visible


def test_rows_pack_like_single_chunks() -> None:
    quantizer = BlockQuantizer(block_size=32)
    rows = torch.randn(3, 50)
    packed = torch.empty(3, quantizer.packed_bytes(50), dtype=torch.uint8)
    quantizer.pack(rows, packed)
    for row, out in zip(rows, quantizer.unpack(packed, 50), strict=True):
        assert torch.equal(out, quantizer.round_trip(row))


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_packed_tail_unpacks_a_few_blocks_at_a_time_as_unpack_does(
    symmetric: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: quantized frozen weights]: `PackedTail.values` in chunks equals `unpack` of the whole chunk, bit for bit;
    packing again gives the same codes."""
    import zeroshard.zero.stage3.packed as packed
    from zeroshard.offload.tier import Tier

    quantizer = BlockQuantizer(symmetric=symmetric)
    values = torch.randn(5_000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tail = packed.PackedTail(quantizer, 0, values.numel(), Tier(torch.device("cpu")))
    tail.pack(values)
    whole = quantizer.unpack(tail.codes, values.numel(), torch.bfloat16)
    monkeypatch.setattr(packed, "UNPACK_CHUNK", 700)  # 3 blocks of 256 (of 20) per part; the last one short
    assert torch.equal(tail.values(torch.bfloat16), whole)
    assert torch.equal(tail.values(torch.float32), quantizer.unpack(tail.codes, values.numel()))
    codes = tail.codes.clone()
    tail.codes.zero_()
    tail.pack(values.clone())
    assert torch.equal(tail.codes, codes)


def test_node_layout() -> None:
    nodes = NodeLayout(world_size=8, ranks_per_node=4)
    assert nodes.nodes == 2 and nodes.node_of(5) == 1 and nodes.local_of(5) == 1
    assert nodes.node_ranks(1) == [4, 5, 6, 7]
    assert nodes.peer_ranks(2) == [2, 6]
    assert nodes.blocks(2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not nodes.spans_nodes([0, 3]) and nodes.spans_nodes([3, 4])
    with pytest.raises(ValueError, match="do not split"):
        NodeLayout(world_size=6, ranks_per_node=4)


def test_node_layout_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("ZEROSHARD_RANKS_PER_NODE", raising=False)
    assert NodeLayout.from_env(16).ranks_per_node == 8
    monkeypatch.setenv("ZEROSHARD_RANKS_PER_NODE", "2")  # the test override wins
    assert NodeLayout.from_env(4).ranks_per_node == 2


def test_comm_stats_count_per_kind_and_per_scope() -> None:
    stats = CommStats()
    stats.record(CollectiveKind.ALL_GATHER, 100, 75.0, Scope.INTER_NODE)
    stats.record(CollectiveKind.ALL_TO_ALL, 40, 20.0, Scope.INTRA_NODE)
    assert stats.kinds["all_gather"].bus_bytes == 75.0 and stats.kinds["all_to_all"].bus_bytes == 20.0
    assert stats.scope_bus_bytes(Scope.INTER_NODE) == 75.0
    assert stats.scope_bus_bytes("intra_node", "all_to_all") == 20.0
    assert stats.scope_snapshot()["intra_node"]["all_gather"]["calls"] == 0
    stats.reset()
    assert stats.total_bus_bytes == 0 and stats.scope_bus_bytes(Scope.INTER_NODE) == 0


def test_zeropp_below_stage_3_is_ignored_with_a_warning(log: pytest.LogCaptureFixture) -> None:  # noqa: F811
    parse_config({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}})
    (line,) = warnings_of(log)
    assert "zero_hpz_partition_size, zero_quantized_gradients (ZeRO++) is ignored at zero_optimization.stage 2" in line
    parse_config({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert len(warnings_of(log)) == 1  # stage 3: implemented, nothing to say
