"""[Note: tensor-parallel resharding] without a process group: any element range of any target slice equals the
same range of `torch.chunk` of the whole tensor, for splits of dims 0, 1 and 2 between tp sizes 1, 2, 3, 4 and 6;
the plan derives the dimension from the shapes, renames the optimizer groups, and refuses slices that are not even
splits of one dimension (by key) and slices of a model an mpu's caller split."""

from __future__ import annotations

import itertools

import pytest
import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import CheckpointMetadata, OptimizerInfo, TensorInfo
from zeroshard.tp.checkpoint import base_of, slice_name, tp_size_of
from zeroshard.tp.reshard import Reslice, _renamed, plan_reslices, read_resliced, shard_dim

SIZES = (1, 2, 3, 4, 6)


@pytest.mark.parametrize(("shape", "dim"), [((12,), 0), ((12, 5), 0), ((4, 12), 1), ((3, 2, 12), 2), ((2, 12, 3), 1)])
def test_every_range_of_every_target_slice_equals_the_chunk(shape: tuple[int, ...], dim: int) -> None:
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    for a, b in itertools.permutations(SIZES, 2):
        sources = [s.contiguous().view(-1) for s in whole.chunk(a, dim)]
        reads: list[tuple[int, int, int]] = []

        def read(j: int, lo: int, hi: int, out: torch.Tensor, sources=sources, reads=reads) -> None:
            reads.append((j, lo, hi))
            out.copy_(sources[j][lo:hi])

        for i, want in enumerate(t.contiguous().view(-1) for t in whole.chunk(b, dim)):
            plan = Reslice(tuple(f"s{j}" for j in range(a)), shape, dim, i, b)
            assert plan.shape == tuple(whole.chunk(b, dim)[i].shape)
            n = want.numel()
            for begin, end in [(0, n), (1, n - 1), (n // 3, n // 2 + 1), (n - 1, n)]:
                out = torch.full((end - begin,), -1.0, dtype=torch.float64)
                read_resliced(plan, begin, end, out, read)
                assert torch.equal(out, want[begin:end]), (shape, dim, a, b, i, begin, end)
        if dim == 0:  # exact reads: never more elements than were asked for
            assert sum(hi - lo for _, lo, hi in reads) == sum(e - s for s, e in _ranges(whole.numel() // b)) * b


def _ranges(n: int) -> list[tuple[int, int]]:
    return [(0, n), (1, n - 1), (n // 3, n // 2 + 1), (n - 1, n)]


def _meta(tensors: dict[str, TensorInfo], groups: list[list[str]]) -> CheckpointMetadata:
    optimizer = OptimizerInfo("AdamW", {}, [{"options": {}, "params": g, "scalars": {}} for g in groups])
    return CheckpointMetadata("t", 4, 2, "float32", "0", "0", {}, {}, tensors, {}, [], {}, {}, optimizer, {})


def _info(*shape: int) -> TensorInfo:
    return TensorInfo(shape, "float32", "param", True, True)


def test_plan_derives_dims_and_renames_groups() -> None:
    saved = {slice_name("q", j, 2): _info(4, 8) for j in range(2)}
    saved.update({slice_name("o", j, 2): _info(8, 4) for j in range(2)}, norm=_info(8))
    meta = _meta(saved, [[slice_name("q", 0, 2), slice_name("q", 1, 2), slice_name("o", 0, 2)], ["norm"]])
    assert tp_size_of(list(saved)) == 2 and base_of(slice_name("q.tp", 1, 2)) == "q.tp"
    assert plan_reslices(meta, {**saved}) == {}  # the same size: nothing to do
    whole = plan_reslices(meta, {"q": _info(8, 8), "o": _info(8, 8), "norm": _info(8)})  # into autotp_size 1
    assert whole["q"].dim == 0 and whole["o"].dim == 1 and whole["o"].full == (8, 8) and "norm" not in whole
    four = {slice_name(k, j, 4): _info(*s) for k, s in (("q", (2, 8)), ("o", (8, 2))) for j in range(4)}
    plans = plan_reslices(meta, {**four, "norm": _info(8)})
    assert plans[slice_name("o", 3, 4)] == Reslice((slice_name("o", 0, 2), slice_name("o", 1, 2)), (8, 8), 1, 3, 4)
    renamed = _renamed(meta, plans)
    assert set(renamed.tensors) == {*four, "norm"} and renamed.tensors[slice_name("q", 2, 4)].shape == (2, 8)
    assert renamed.optimizer is not None
    assert renamed.optimizer.groups[0]["params"] == [slice_name(k, j, 4) for k in "qo" for j in range(4)]
    assert renamed.optimizer.groups[1]["params"] == ["norm"]
    engine = {slice_name("q", j, 2): _info(4, 8) for j in range(2)}  # its own slice and its peer's
    split = plan_reslices(_meta({"q": _info(8, 8)}, [["q"]]), engine)
    assert split[slice_name("q", 1, 2)] == Reslice(("q",), (8, 8), 0, 1, 2)  # from a checkpoint without tp


def test_uneven_or_mixed_slices_refused_by_key() -> None:
    assert shard_dim("w", (4, 8), 2, (8, 8), 1) == 0
    with pytest.raises(CheckpointError, match=r"q: the checkpoint's slices have shape \(4, 8\) \(autotp_size=2\)"):
        shard_dim("q", (4, 8), 2, (8, 4), 1)
    mixed = {slice_name("q", 0, 2): _info(4), slice_name("k", 0, 4): _info(2)}
    with pytest.raises(CheckpointError, match=r"checkpoint's tensors are sliced for several autotp_size .*\[2, 4\]"):
        plan_reslices(_meta(mixed, []), {"q": _info(8)})
    mpu = _meta({slice_name("q", j, 2): _info(4) for j in range(2)}, [])
    assert plan_reslices(mpu, {"q": _info(8)})  # DTensor slices: plain splits
    mpu.extra["tensor_parallel_caller_split"] = True
    with pytest.raises(CheckpointError, match="model split by the caller .* load it with model-parallel size 2"):
        plan_reslices(mpu, {"q": _info(8)})
    with pytest.raises(CheckpointError, match="this engine holds slices of a model split by the caller"):
        plan_reslices(_meta({"q": _info(8)}, []), {slice_name("q", j, 2): _info(4) for j in range(2)}, True)


def _pieces(whole: torch.Tensor, parts: int, k: int, dim: int) -> list[torch.Tensor]:
    """Slices of a fused tensor of `k` equal parts along `dim` over `parts` ranks: rank i holds piece i of every
    part, side by side ([Note: fused sub-parameters]: `_StridedShard(dim, split_factor=k)`)."""
    if parts == 1:
        return [whole]
    return [torch.cat([part.chunk(parts, dim)[i] for part in whole.chunk(k, dim)], dim) for i in range(parts)]


@pytest.mark.parametrize(("shape", "dim", "k"), [((36, 5), 0, 3), ((24,), 0, 2), ((3, 24, 2), 1, 4)])
def test_fused_parts_reslice_as_their_pieces(shape: tuple[int, ...], dim: int, k: int) -> None:
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    for a, b in itertools.permutations((1, 2, 3, 6), 2):
        sources = [s.contiguous().view(-1) for s in _pieces(whole, a, k, dim)]

        def read(j: int, lo: int, hi: int, out: torch.Tensor, sources=sources) -> None:
            out.copy_(sources[j][lo:hi])

        for i, want in enumerate(t.contiguous().view(-1) for t in _pieces(whole, b, k, dim)):
            plan = Reslice(tuple(f"s{j}" for j in range(a)), shape, dim, i, b, k)
            n = want.numel()
            for begin, end in _ranges(n):
                out = torch.full((end - begin,), -1.0, dtype=torch.float64)
                read_resliced(plan, begin, end, out, read)
                assert torch.equal(out, want[begin:end]), (shape, dim, k, a, b, i, begin, end)


def test_fused_parts_recorded_planned_and_refused_when_they_differ() -> None:
    saved = _meta({slice_name("qkv", j, 2): _info(6, 4) for j in range(2)}, [])
    saved.extra["tensor_parallel_blocks"] = {"qkv": 3}
    three = {slice_name("qkv", j, 3): _info(4, 4) for j in range(3)}
    assert plan_reslices(saved, three, blocks={"qkv": 3})[slice_name("qkv", 2, 3)].blocks == 3
    assert plan_reslices(saved, {"qkv": _info(12, 4)})["qkv"].blocks == 3  # into a whole tensor: the saved parts
    with pytest.raises(CheckpointError, match=r"qkv was split in 3 equal part\(s\) per slice and this engine .* in 1"):
        plan_reslices(saved, three)
    with pytest.raises(CheckpointError, match="qkv was split in 3"):  # the same size, other parts: not read as is
        plan_reslices(saved, {slice_name("qkv", j, 2): _info(6, 4) for j in range(2)}, blocks={"qkv": 2})
    assert plan_reslices(saved, {slice_name("qkv", j, 2): _info(6, 4) for j in range(2)}, blocks={"qkv": 3}) == {}
    whole = _meta({"qkv": _info(12, 4)}, [])
    assert plan_reslices(whole, three, blocks={"qkv": 3})[slice_name("qkv", 0, 3)].blocks == 3
