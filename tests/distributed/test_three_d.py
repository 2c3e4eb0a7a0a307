"""3D parallelism (pp2 x tp2 x dp2 on 8 gloo ranks): a PipelineModule whose blocks are Megatron-style column- then
row-parallel linear pairs over a fake mpu's tensor-parallel groups, ZeRO stage 1 over its data-parallel groups,
gradient clipping active every step (1F1B and interleaved 1F1B fed by data_iter, GPipe by the engine's loader over
training_data, its PipelineModule split by zeroshard.pipe's PipeModelDataParallelTopology); every rank's loss
equals a single-process reference (the same full weights, the same global batch, torch AdamW) within 1e-5 relative
at every step and in an eval_batch after the last. Then, in the same spawn, initialize
refuses an mpu whose pipeline size is not num_stages, and one whose groups are not laid out as DeepSpeed's
PipeModelDataParallelTopology ([Note: 3D mesh] in pipe/three_d.py) and autotp_size with a PipelineModule; a 3D
checkpoint resumes with the losses of the uninterrupted run exactly, and a pp2 x dp4 engine refuses to load it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.harness import run_on_ranks
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
    `tp_stride` DP, a layout whose tp ranks are not consecutive; `pipe` is the pipeline size it reports."""

    def __init__(self, rank: int, pipe: int = PP, tp_stride: int = 1) -> None:
        lanes = TP * DP
        dp_stride = TP if tp_stride == 1 else 1
        stage, lane = divmod(rank, lanes)
        self.tp_rank, self.dp_rank = (lane % TP, lane // TP) if tp_stride == 1 else (lane // DP, lane % DP)
        self.tp_size, self.dp_size = TP, DP
        self.pipe = pipe
        for s in range(PP):
            for d in range(DP):
                group = dist.new_group([s * lanes + d * dp_stride + t * tp_stride for t in range(TP)])
                if (s, d) == (stage, self.dp_rank):
                    self.tp_group = group
            for t in range(TP):
                group = dist.new_group([s * lanes + d * dp_stride + t * tp_stride for d in range(DP)])
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


def _engine(rank: int, mpu: FakeMpu, schedule: str, extra: dict[str, Any] | None = None, mpu_given: bool = True) -> Any:
    import zeroshard
    from zeroshard.pipe import PipelineModule, PipeModelDataParallelTopology

    w = Weights.make()
    blocks = [ParallelBlock(b, mpu.tp_rank, mpu.tp_group) for b in w.blocks]
    layers = [_linear(w.embed), nn.Tanh(), *blocks, _linear(w.head)]
    topology = PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=DP)
    split: dict[str, Any] = {"num_stages": PP} if schedule == "1f1b" else {"topology": topology}
    net = PipelineModule(layers=layers, loss_fn=nn.functional.mse_loss, partition_method="uniform", **split)
    data = dataset() if schedule == "gpipe" else None  # gpipe reads through the engine's loader
    cfg = {**config(schedule), **(extra or {})}
    return zeroshard.initialize(model=net, config=cfg, mpu=mpu if mpu_given else None, training_data=data)[0]


def _train(rank: int, world_size: int, schedules: list[str], save_dir: str) -> dict[str, Any]:
    from zeroshard.comm.topology import init_distributed
    from zeroshard.errors import ConfigError

    init_distributed()  # the mpu's groups come first, as Megatron's initialize_model_parallel
    out: dict[str, Any] = {}
    for schedule in schedules:
        engine = _engine(rank, FakeMpu(rank), schedule)
        assert engine.dp_world_size == DP, engine.dp_world_size
        d = engine.pipe.data_parallel_rank
        it = iter([mb for step in batches() for mb in step[d]])
        out[schedule] = [float(engine.train_batch(data_iter=it if schedule != "gpipe" else None)) for _ in range(STEPS)]
        out[schedule].append(float(engine.eval_batch(data_iter=iter(batches()[0][d]))))
        engine.destroy()
    out.update(_resume(rank, save_dir))
    for name, mpu in (("pipe", FakeMpu(rank, pipe=4)), ("layout", FakeMpu(rank, tp_stride=DP))):
        try:
            _engine(rank, mpu, "1f1b")
            out[name] = "accepted"
        except ConfigError as e:
            out[name] = str(e)
    try:
        _engine(rank, FakeMpu(rank), "1f1b", {"tensor_parallel": {"autotp_size": TP}}, mpu_given=False)
        out["autotp"] = "accepted"
    except ConfigError as e:
        out["autotp"] = str(e)
    return out


def _steps(engine: Any, steps: list[list[list[tuple[torch.Tensor, torch.Tensor]]]]) -> list[float]:
    d = engine.pipe.data_parallel_rank
    it = iter([mb for step in steps for mb in step[d]])
    return [float(engine.train_batch(data_iter=it)) for _ in steps]


def _resume(rank: int, save_dir: str) -> dict[str, Any]:
    """[Note: 3D checkpoints]: 2 steps, save, 2 more; a fresh engine loads and trains the same 2 steps. Then a
    pp2 x dp4 engine (no mpu) refuses the checkpoint."""
    from zeroshard.errors import ZeroshardError

    stream = batches()
    engine = _engine(rank, FakeMpu(rank), "1f1b")
    _steps(engine, stream[:2])
    engine.save_checkpoint(save_dir)
    out: dict[str, Any] = {"straight": _steps(engine, stream[2:4])}
    engine.destroy()
    engine = _engine(rank, FakeMpu(rank), "1f1b")
    engine.load_checkpoint(save_dir)
    out["resumed"] = _steps(engine, stream[2:4])
    engine.destroy()
    engine = _engine(rank, FakeMpu(rank), "1f1b", mpu_given=False)
    try:
        engine.load_checkpoint(save_dir)
        out["checkpoint"] = "accepted"
    except ZeroshardError as e:
        out["checkpoint"] = str(e)
    engine.destroy()
    return out


class Reference(nn.Module):
    def __init__(self, w: Weights) -> None:
        super().__init__()
        self.embed, self.head = _linear(w.embed), _linear(w.head)
        self.blocks = nn.ParameterList([nn.Parameter(t.clone()) for b in w.blocks for t in b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for i in range(BLOCKS):
            w1, b1, w2, b2 = self.blocks[4 * i : 4 * i + 4]
            x = x + nn.functional.linear(torch.tanh(nn.functional.linear(x, w1, b1)), w2) + b2
        return self.head(x)


def reference() -> list[float]:
    """Plain PyTorch on one process: the whole global batch per step, gradients averaged over it."""
    model = Reference(Weights.make())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in batches():
        total = 0.0
        for replica in step:
            for x, y in replica:
                loss = nn.functional.mse_loss(model(x), y)
                (loss / (GAS * DP)).backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total / (GAS * DP))
    with torch.no_grad():  # eval_batch over step 0's data with the trained model
        evals = [nn.functional.mse_loss(model(x), y).item() for replica in batches()[0] for x, y in replica]
    return losses + [sum(evals) / len(evals)]


def test_pp2_tp2_dp2_matches_reference_and_refuses_inconsistent_mpu(tmp_path: Path) -> None:
    schedules = ["1f1b", "gpipe", "interleaved"]
    per_rank = run_on_ranks(_train, PP * TP * DP, schedules, str(tmp_path))
    want = reference()
    for rank, result in enumerate(per_rank):
        for schedule in schedules:
            got = result[schedule]
            assert all(math.isclose(g, w, rel_tol=RTOL) for g, w in zip(got, want, strict=True)), (
                rank,
                schedule,
                got,
                want,
            )
        assert "pipeline size 4 != the PipelineModule's num_stages 2" in result["pipe"], result["pipe"]
        assert "PipeModelDataParallelTopology" in result["layout"], result["layout"]
        assert result["resumed"] == result["straight"], (rank, result["resumed"], result["straight"])
        assert "saved with num_stages 2 and tensor_parallel 2" in result["checkpoint"], result["checkpoint"]
        assert "\n" not in result["checkpoint"]
        assert "autotp x pp is not implemented" in result["autotp"], result["autotp"]
