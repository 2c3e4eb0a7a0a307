"""A small MoE model, its single-process reference (all experts local) and the engine-side runner.

The reference holds all `E` experts and runs each rank's micro-batch through the model separately (gating
capacity is counted on each rank's tokens, [Note: gating]), averaging the per-rank losses as the engine's
gradient mean does; torch's AdamW steps it. Expert g starts from a seed of its own on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

D, T, B = 8, 6, 2  # hidden size, tokens per sequence, sequences per rank
LR = 1e-2


@dataclass(frozen=True)
class MoeCase:
    k: int = 1
    num_experts: int = 4
    drop_tokens: bool = True
    capacity_factor: float = 1.0
    uneven: bool = False  # rank 0 sends every token to expert 0
    stage: int = 1
    steps: int = 4
    gas: int = 1
    offload: bool = False  # offload_optimizer cpu
    frozen_experts: bool = False  # the experts do not train (no part holds them: [Note: expert checkpoints])

    @property
    def name(self) -> str:
        drop, uneven = int(self.drop_tokens), int(self.uneven)
        extra = ("-offload" if self.offload else "") + ("-frozen" if self.frozen_experts else "")
        return f"k{self.k}-E{self.num_experts}-drop{drop}-uneven{uneven}-s{self.stage}-gas{self.gas}{extra}"


class MoeNet(nn.Module):
    def __init__(self, case: MoeCase, ep_size: int, expert_groups: object | None = None, data_first: bool = False):
        from zeroshard.moe import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.moe = MoE(
            D,
            expert,
            num_experts=case.num_experts,
            ep_size=ep_size,
            k=case.k,
            capacity_factor=case.capacity_factor,
            eval_capacity_factor=case.capacity_factor,
            min_capacity=1,
            drop_tokens=case.drop_tokens,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            expert_groups=expert_groups,  # type: ignore[arg-type]
        )
        self.head = nn.Linear(D, 1)
        if case.uneven:  # [Note: expert exchange]: a positive first feature routes to expert 0
            with torch.no_grad():
                self.inp.weight[0].zero_()  # the gate's input keeps the first feature
                self.inp.weight[0, 0], self.inp.bias[0] = 1.0, 0.0
                self.moe.gate.wg.weight.zero_()
                self.moe.gate.wg.weight[0, 0] = 20.0
        first = (ep_rank(ep_size, data_first)) * self.moe.num_local_experts
        for local, module in enumerate(self.moe.experts.deepspeed_experts):
            seed_expert(module, first + local)
        if case.frozen_experts:
            self.moe.experts.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out, l_aux, _ = self.moe(h)
        return torch.nn.functional.mse_loss(self.head(h + out).squeeze(-1), y) + 0.01 * l_aux


def ep_rank(ep_size: int, data_first: bool = False) -> int:
    """Which experts this rank holds: "E + D" (consecutive expert-parallel groups) or DeepSpeed's "D + E"
    (use_data_before_expert_parallelism: strided ones)."""
    import torch.distributed as dist

    if not dist.is_initialized() or ep_size == 1:
        return 0
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank // (world // ep_size) if data_first else rank % ep_size


def seed_expert(module: nn.Module, global_id: int) -> None:
    gen = torch.Generator().manual_seed(1000 + global_id)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def batch(case: MoeCase, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(B, T, D, generator=gen)
    if case.uneven:
        x[..., 0] = x[..., 0].abs() + 0.5 if rank == 0 else -x[..., 0].abs() - 0.5
    return x, torch.randn(B, T, generator=gen)


def config(case: MoeCase) -> dict:
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": case.gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": case.stage,
            "reduce_bucket_size": 64,
            "allgather_bucket_size": 64,
            **({"offload_optimizer": {"device": "cpu"}} if case.offload else {}),
        },
    }


def reference_losses(case: MoeCase, world_size: int) -> list[list[float]]:
    """Per step, every rank's loss, from one process holding all experts."""
    return _reference(case, world_size)[0]


def reference_norms(case: MoeCase, world_size: int) -> list[float]:
    """Per step, the global gradient norm before clipping."""
    return _reference(case, world_size)[1]


def _reference(case: MoeCase, world_size: int) -> tuple[list[list[float]], list[float]]:
    model = MoeNet(case, ep_size=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    out, norms = [], []
    for step in range(case.steps):
        micro = range(step * case.gas, (step + 1) * case.gas)
        losses = [model(*batch(case, m, r)) for m in micro for r in range(world_size)]
        opt.zero_grad()
        (torch.stack(losses).mean()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        out.append([float(v.detach()) for v in losses])
    return out, norms


def engine_losses(rank: int, case: MoeCase, ep_size: int) -> dict[str, list[float]]:
    """Per-step losses, this rank's first-step expert loads, and how the expert part is sharded."""
    import zeroshard

    model = MoeNet(case, ep_size)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
    out: dict[str, list[float]] = {"losses": [], "norms": []}
    for step in range(case.steps * case.gas):  # one micro-step each; the engine steps on the boundary
        x, y = batch(case, step, rank)
        if step == 0:
            with torch.no_grad():
                out["counts"] = [float(c) for c in model.moe(model.inp(x))[2]]
        loss = engine(x, y)
        engine.backward(loss)
        if step == case.gas - 1:  # the first boundary: the reduced gradients, by global name
            out["grads"] = _full_grads(model, ep_size)  # type: ignore[assignment]
            out["set_grad_round_trip"] = [_set_grad_round_trip(model)]
        engine.step()
        out["losses"].append(float(loss.detach()))
        if step % case.gas == case.gas - 1:
            out["norms"].append(float(engine.get_global_grad_norm()))
    if ep_size > 1 and case.stage == 3:  # the experts' units ([Note: experts at stage 3])
        unit = next(u for u in engine.strategy.units if u.name.endswith("deepspeed_moe.experts"))
        out["expert_sharding"] = [float(unit.comm.world_size), float(unit.layout.shard_count)]
    elif ep_size > 1:
        experts = engine.strategy.parts[1]
        out["expert_sharding"] = [float(experts.comm.world_size), float(experts.layout.shard_count)]
    engine.destroy()
    return out


def _global_name(name: str, first: int) -> str:
    """A local expert's parameter name with its global expert id (`first`: this rank's first expert)."""
    head, sep, tail = name.partition("deepspeed_experts.")
    if not sep:
        return name
    local, _, rest = tail.partition(".")
    return f"{head}{sep}{first + int(local)}.{rest}"


def _full_grads(model: nn.Module, ep_size: int) -> dict[str, torch.Tensor]:
    from zeroshard.utils import safe_get_full_grad

    first = ep_rank(ep_size) * model.moe.num_local_experts
    out = {}
    for name, param in model.named_parameters():
        grad = safe_get_full_grad(param)  # every rank, every parameter: collective
        if grad is not None:
            out[_global_name(name, first)] = grad
    return out


def reference_grads(case: MoeCase, world_size: int) -> dict[str, torch.Tensor]:
    """The first step's gradients (of the mean loss over its micro-steps and ranks) in one process."""
    model = MoeNet(case, ep_size=1)
    losses = [model(*batch(case, m, r)) for m in range(case.gas) for r in range(world_size)]
    torch.stack(losses).mean().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _set_grad_round_trip(model: nn.Module) -> float:
    """`safe_set_full_grad` of twice each gradient, read back (the expert part's scale differs from the dense part's:
    [Note: setting a gradient]); the largest difference, then every gradient set back as it was."""
    from zeroshard.utils import safe_get_full_grad, safe_set_full_grad

    worst = 0.0
    for param in (p for p in model.parameters() if p.requires_grad):
        grad = safe_get_full_grad(param)
        safe_set_full_grad(param, grad * 2)
        worst = max(worst, float((safe_get_full_grad(param) - grad * 2).abs().max()))
        safe_set_full_grad(param, grad)
    return worst


def resume_losses(
    rank: int, case: MoeCase, ep_size: int, save_dir: str, save_at: int
) -> tuple[list[float], list[float]]:
    """Losses of `case.steps` uninterrupted steps, and of a second engine loading the checkpoint the first saved
    after `save_at` steps and running the rest (from a differently seeded start, so the load must restore)."""
    import zeroshard

    def run(engine: object, steps: range) -> list[float]:
        out = []
        for step in steps:
            loss = engine(*batch(case, step, rank))  # type: ignore[operator]
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            out.append(float(loss))
        return out

    model = MoeNet(case, ep_size)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
    straight = run(engine, range(save_at))
    engine.save_checkpoint(save_dir, tag="mid")
    straight += run(engine, range(save_at, case.steps))
    whole = engine.strategy.full_state_dict()  # every expert of every rank, under global names
    experts = sorted({k.split("deepspeed_experts.")[1].split(".")[0] for k in whole if "deepspeed_experts." in k})
    assert experts == [str(e) for e in range(case.num_experts)], experts
    mine = ep_rank(ep_size) * model.moe.num_local_experts
    first = model.moe.experts.deepspeed_experts[0][0].weight
    with zeroshard.zero.GatheredParameters([first]):  # (whole at stages 1-2 already)
        assert torch.equal(whole[f"moe.deepspeed_moe.experts.deepspeed_experts.{mine}.0.weight"], first)
    engine.destroy()
    fresh = MoeNet(case, ep_size)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.5)
    engine, _, _, _ = zeroshard.initialize(model=fresh, model_parameters=fresh.parameters(), config=config(case))
    engine.load_checkpoint(save_dir, tag="mid")
    resumed = run(engine, range(save_at, case.steps))
    engine.destroy()
    return straight, resumed


def full_states(engine: object, model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of every parameter this rank holds, experts under their global names."""
    from zeroshard.moe.checkpoint import global_expert_names
    from zeroshard.moe.zero import ExpertSplitStrategy

    strategy = engine.strategy  # type: ignore[attr-defined]
    split = isinstance(strategy, ExpertSplitStrategy)
    out = {k: v.clone() for k, v in (strategy.full_state_dict() if split else model.state_dict()).items()}
    names = global_expert_names(strategy.module)[0] if split else {}
    for key in ("exp_avg", "exp_avg_sq"):
        for name, param in model.named_parameters():
            out[f"{key}:{names.get(name, name)}"] = strategy.full_optimizer_state(param, key).clone()
    return out


def saved_states(rank: int, case: MoeCase, ep_size: int, save_dir: str) -> dict[str, torch.Tensor]:
    import zeroshard

    model = MoeNet(case, ep_size)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
    for step in range(2):
        loss = engine(*batch(case, step, rank))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    return full_states(engine, model)


def loaded_states(rank: int, case: MoeCase, ep_size: int, save_dir: str) -> dict[str, torch.Tensor]:
    import zeroshard

    model = MoeNet(case, ep_size)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
    engine.load_checkpoint(save_dir, tag="t")
    states = full_states(engine, model)
    loss = engine(*batch(case, 5, rank))  # and it trains on
    engine.backward(loss)
    engine.step()
    return states
