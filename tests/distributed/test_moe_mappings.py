"""`gather_tokens` / `drop_tokens` on 2 gloo ranks against DeepSpeed 0.19.8's `deepspeed.moe.mappings`, the same
inputs and the same mpu in the same ranks: forward outputs and input gradients bit-equal, along dims 0 and 1, with
a contiguous and a non-contiguous input, for an mpu of Megatron's current names and one of the oldest names, and
for an engine built with that mpu (which `initialize` puts at `groups.mpu`, as DeepSpeed's engine does) and its
published tensor-parallel group. Each result is also checked against the concatenation / slice it should be. With
one tensor-parallel rank, or no mpu and no engine, the input comes back as it is; a dimension that does not split
over the ranks is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.mpu import GroupsMpu

SHAPE = (4, 6)


class _Megatron:
    """Megatron-LM's current names: tensor-parallel group of both ranks."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size

    def get_tensor_model_parallel_group(self) -> Any:
        return self.group


class _Old(GroupsMpu):
    """The oldest names (`get_model_parallel_*`), with the data-parallel ones an engine needs: one rank each."""

    def __init__(self, group: Any, rank: int, size: int, dp_group: Any) -> None:
        self.tp_group, self.tp_rank, self.tp_size = group, rank, size
        self.dp_group, self.dp_rank, self.dp_size = dp_group, 0, 1


def _inputs(rank: int, contiguous: bool) -> Any:
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    if contiguous:
        return torch.randn(SHAPE, generator=gen)
    return torch.randn(tuple(reversed(SHAPE)), generator=gen).t()


def _run(fn: Any, x: Any, dim: int, weight_seed: int) -> tuple[Any, Any]:
    """`fn(x, dim)` and the gradient of a weighted sum of its output (weights from `weight_seed`) with respect to x."""
    import torch

    x = x.clone().requires_grad_()
    y = fn(x, dim)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(weight_seed))
    (y * weights).sum().backward()
    return y.detach(), x.grad


def _compare(rank: int, ours: Any, theirs: Any) -> dict[str, bool]:
    """Our gather and drop against DeepSpeed's over the tensor-parallel group of 2, and against what they should be."""
    import torch

    out = {}
    for dim in (0, 1):
        for contiguous in (True, False):
            case = f"dim {dim}{'' if contiguous else ', non-contiguous'}"
            mine, every = _inputs(rank, contiguous), [_inputs(r, contiguous) for r in range(2)]
            y, grad = _run(ours.gather_tokens, mine, dim, 7)  # the same weights on both ranks
            y_ds, grad_ds = _run(theirs.gather_tokens, mine, dim, 7)
            weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
            n = SHAPE[dim]
            out[f"gather {case}: DeepSpeed's"] = torch.equal(y, y_ds) and torch.equal(grad, grad_ds)
            out[f"gather {case}: expected"] = torch.equal(y, torch.cat(every, dim)) and torch.equal(
                grad, weights.narrow(dim, rank * n, n)
            )
            whole = every[0]  # a drop's input: the same on both ranks; its output's weights differ per rank
            y, grad = _run(ours.drop_tokens, whole, dim, 20 + rank)
            y_ds, grad_ds = _run(theirs.drop_tokens, whole, dim, 20 + rank)
            half = SHAPE[dim] // 2
            each = [torch.randn(y.shape, generator=torch.Generator().manual_seed(20 + r)) for r in range(2)]
            out[f"drop {case}: DeepSpeed's"] = torch.equal(y, y_ds) and torch.equal(grad, grad_ds)
            out[f"drop {case}: expected"] = torch.equal(y, whole.narrow(dim, rank * half, half)) and torch.equal(
                grad, torch.cat(each, dim)
            )
    return out


def _flat_all_gather(ds_comm: Any) -> None:
    """DeepSpeed's gather hands `all_gather_into_tensor` a flat output and the input in its shape: NCCL takes that,
    gloo refuses it ("invalid tensor size ... expected (4, 6), got (24)"). The reference's input goes over flat here:
    the same bytes in the same rank-major layout, DeepSpeed's own reassembly and autograd after it."""
    gather = ds_comm.all_gather_into_tensor

    def flat(output: Any, tensor: Any, **kwargs: Any) -> Any:
        return gather(output, tensor.reshape(-1), **kwargs)

    ds_comm.all_gather_into_tensor = flat


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    import zeroshard
    from zeroshard.moe import mappings as ours
    from zeroshard.utils import groups

    deepspeed = import_deepspeed()
    from deepspeed.moe import mappings as theirs

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's all-gather goes through its comm backend
    _flat_all_gather(deepspeed.comm)
    both = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    out: dict[str, Any] = {}
    x = torch.randn(SHAPE)
    out["no mpu, no engine"] = ours.gather_tokens(x, 1) is x and ours.drop_tokens(x, 1) is x

    mpus = {"megatron": _Megatron(both, rank, 2), "old": _Old(both, rank, 2, alone)}
    for name, mpu in mpus.items():
        groups.mpu = deepspeed.utils.groups.mpu = mpu
        out |= {f"{name} mpu, {case}": ok for case, ok in _compare(rank, ours, theirs).items()}
    groups.mpu = deepspeed.utils.groups.mpu = _Megatron(alone, 0, 1)
    out["one tensor-parallel rank"] = ours.gather_tokens(x, 0) is x and ours.drop_tokens(x, 0) is x
    groups.mpu = mpus["megatron"]
    try:
        ours.drop_tokens(torch.randn(3, 6), 0)
    except ValueError as err:
        out["indivisible"] = str(err)

    groups.mpu = None
    deepspeed.utils.groups.mpu = mpus["old"]
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = nn.Linear(4, 4)
    engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpus["old"])[0]
    out["initialize sets groups.mpu"] = groups.mpu is mpus["old"]
    out |= {f"engine's mpu, {case}": ok for case, ok in _compare(rank, ours, theirs).items()}
    groups.mpu = None  # a script that clears it: the engine's published tensor-parallel group answers
    out |= {f"engine's group, {case}": ok for case, ok in _compare(rank, ours, theirs).items()}
    engine.destroy()
    groups.mpu = None  # DeepSpeed leaves it after the engine; without it the published groups answer
    out["after the engine"] = ours.gather_tokens(x, 0) is x
    return out


def test_gather_and_drop_tokens_match_deepspeed() -> None:
    for out in run_on_ranks(_cases, 2, timeout=120):
        assert out.pop("indivisible") == (
            "drop_tokens: dimension 0 has 3 elements, which do not split over 2 tensor-parallel ranks; pad it to a "
            "multiple of 2"
        )
        assert len(out) == 4 + 4 * 16
        assert [case for case, ok in out.items() if not ok] == []


@pytest.mark.parametrize("name", ["gather_tokens", "drop_tokens"])
def test_without_tensor_parallelism_the_input_comes_back(name: str) -> None:
    import torch

    from zeroshard.moe import mappings

    x = torch.randn(SHAPE)
    assert getattr(mappings, name)(x) is x and getattr(mappings, name)(x, dim=1) is x
