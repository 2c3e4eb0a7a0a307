"""The 3D model of tests/distributed/test_three_d.py and test_pipeline_reshard.py: Megatron-style column- then
row-parallel blocks over a fake mpu's tensor-parallel groups in a PipelineModule, its data, config, engine builder and
a single-process reference (the same full weights, the same global batch, torch AdamW).

The data is always the reference's, DP replicas a step; an engine of `dp` replicas reads them as `replica_stream`
says, so a pp x tp x dp1 engine sees the global batch of pp x tp x dp2 ([Note: pipeline checkpoints]).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.mpu import GroupsMpu

PP, TP, DP = 2, 2, 2
WIDTH, HIDDEN, BLOCKS, SEED = 8, 16, 4, 5
MICRO, GAS, STEPS, CLIP, LR = 2, 4, 4, 0.05, 1e-2
RTOL = 1e-5


@dataclass(frozen=True)
class Weights:
    """The full model: an input projection, BLOCKS residual MLP blocks, a head."""

    embed: torch.Tensor
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # w1 (H, W), b1, w2 (W, H), b2
    head: torch.Tensor

    @classmethod
    def make(cls) -> Weights:
        g = torch.Generator().manual_seed(SEED)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * 0.3

        blocks = [(rand(HIDDEN, WIDTH), rand(HIDDEN), rand(WIDTH, HIDDEN), rand(WIDTH)) for _ in range(BLOCKS)]
        return cls(rand(WIDTH, WIDTH), blocks, rand(WIDTH, WIDTH))


class _CopyToTP(torch.autograd.Function):
    """Megatron's copy_to_tensor_model_parallel_region: identity forward, gradients summed over tp backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: partial sums added over tp, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split(full: torch.Tensor, dim: int, t: int) -> nn.Parameter:
    param = nn.Parameter(full.chunk(TP, dim=dim)[t].clone())
    param.tensor_model_parallel = True  # type: ignore[attr-defined]  # Megatron's mark, read by is_tp_sharded
    return param


class ParallelBlock(nn.Module):
    """x + RowParallel(tanh(ColumnParallel(x))): this rank's 1/TP of the hidden units; b2 replicated."""

    def __init__(self, weights: tuple[torch.Tensor, ...], t: int, group: Any) -> None:
        super().__init__()
        w1, b1, w2, b2 = weights
        self.w1, self.b1, self.w2 = _split(w1, 0, t), _split(b1, 0, t), _split(w2, 1, t)
        self.b2 = nn.Parameter(b2.clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(_CopyToTP.apply(x, self.group), self.w1, self.b1))
        return x + _ReduceFromTP.apply(nn.functional.linear(h, self.w2), self.group) + self.b2


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(WIDTH, WIDTH, bias=False)
    layer.weight.data.copy_(weight)
    return layer


class FakeMpu(GroupsMpu):
    """DeepSpeed's mpu methods over groups laid out as PipeModelDataParallelTopology (`tp_stride` 1) or, with
    `tp_stride` dp, a layout whose tp ranks are not consecutive; `pipe` is the pipeline size it reports and `dp`
    the data-parallel size of the world (PP x TP x dp ranks)."""

    def __init__(self, rank: int, pipe: int = PP, tp_stride: int = 1, dp: int = DP) -> None:
        lanes = TP * dp
        dp_stride = TP if tp_stride == 1 else 1
        stage, lane = divmod(rank, lanes)
        self.tp_rank, self.dp_rank = (lane % TP, lane // TP) if tp_stride == 1 else (lane // dp, lane % dp)
        self.tp_size, self.dp_size = TP, dp
        self.pipe = pipe
        for s in range(PP):
            for d in range(dp):
                group = dist.new_group([s * lanes + d * dp_stride + t * tp_stride for t in range(TP)])
                if (s, d) == (stage, self.dp_rank):
                    self.tp_group = group
            for t in range(TP):
                group = dist.new_group([s * lanes + d * dp_stride + t * tp_stride for d in range(dp)])
                if (s, t) == (stage, self.tp_rank):
                    self.dp_group = group

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe


def batches() -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """[step][replica d][micro] -> (inputs, targets)."""
    g = torch.Generator().manual_seed(11)

    def micro() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)

    return [[[micro() for _ in range(GAS)] for _ in range(DP)] for _ in range(STEPS)]


def replica_stream(dp: int, d: int, steps: range) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Replica d of a dp-replica engine reads the reference replicas [d * k, (d + 1) * k) of each step in turn,
    k = DP // dp (with gradient_accumulation_steps GAS * k): the reference's global batch on either mesh."""
    k = DP // dp
    data = batches()
    return iter([mb for s in steps for replica in data[s][d * k : (d + 1) * k] for mb in replica])


def config(schedule: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "pipeline": {"stages": PP, "schedule": schedule},
    }


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same samples as `batches`, in the order the pipeline loader (DistributedSampler over DP replicas,
    without shuffling) hands replica d its micro-batches: sample i of replica d's stream at index i * DP + d."""
    streams = [[(x[j], y[j]) for step in batches() for x, y in step[d] for j in range(MICRO)] for d in range(DP)]
    return [streams[d][i] for i in range(len(streams[0])) for d in range(DP)]


class Projection(nn.Linear):
    """`_linear` as a class, for a LayerSpec."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(WIDTH, WIDTH, bias=False)
        self.weight.data.copy_(weight)


def _transposed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}  # the update follows the clipping norm


def build_engine(
    rank: int,
    mpu: FakeMpu,
    schedule: str,
    extra: dict[str, Any] | None = None,
    mpu_given: bool = True,
    tied: bool = False,
) -> Any:
    """`tied`: the head is the input projection's weight transposed, a TiedLayerSpec on both stages (as
    Megatron-DeepSpeed's GPT ties its embedding and output layer)."""
    import zeroshard
    from zeroshard.pipe import PipelineModule, PipeModelDataParallelTopology, TiedLayerSpec

    w = Weights.make()
    blocks = [ParallelBlock(b, mpu.tp_rank, mpu.tp_group) for b in w.blocks]
    layers: list[Any] = [_linear(w.embed), nn.Tanh(), *blocks, _linear(w.head)]
    if tied:
        layers[0] = TiedLayerSpec("embed", Projection, w.embed)
        layers[-1] = TiedLayerSpec("embed", Projection, w.embed, forward_fn=_transposed)
    topology = PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=mpu.dp_size)
    split: dict[str, Any] = {"num_stages": PP} if schedule == "1f1b" else {"topology": topology}
    net = PipelineModule(layers=layers, loss_fn=nn.functional.mse_loss, partition_method="uniform", **split)
    data = dataset() if schedule == "gpipe" else None  # gpipe reads through the engine's loader
    cfg = {**config(schedule), **(extra or {})}
    return zeroshard.initialize(model=net, config=cfg, mpu=mpu if mpu_given else None, training_data=data)[0]


class Reference(nn.Module):
    def __init__(self, w: Weights, tied: bool = False) -> None:
        super().__init__()
        self.embed, self.head = _linear(w.embed), _linear(w.head)
        self.tied = tied
        self.blocks = nn.ParameterList([nn.Parameter(t.clone()) for b in w.blocks for t in b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for i in range(BLOCKS):
            w1, b1, w2, b2 = self.blocks[4 * i : 4 * i + 4]
            x = x + nn.functional.linear(torch.tanh(nn.functional.linear(x, w1, b1)), w2) + b2
        return _transposed(self.embed, x) if self.tied else self.head(x)


def reference(tied: bool = False, sgd: bool = False) -> list[float]:
    """Plain PyTorch on one process: the whole global batch per step, gradients averaged over it."""
    model = Reference(Weights.make(), tied)
    params = [p for name, p in model.named_parameters() if not (tied and name.startswith("head"))]
    lr = SGD["optimizer"]["params"]["lr"]
    opt = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.AdamW(params, lr=LR, weight_decay=0.01)
    losses = []
    for step in batches():
        total = 0.0
        for replica in step:
            for x, y in replica:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (GAS * DP)).backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total / (GAS * DP))
    with torch.no_grad():  # eval_batch over step 0's data with the trained model
        evals = [nn.functional.mse_loss(model(x), y).item() for replica in batches()[0] for x, y in replica]
    return losses + [sum(evals) / len(evals)]
