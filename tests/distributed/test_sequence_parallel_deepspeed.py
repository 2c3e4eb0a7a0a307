"""Ulysses against DeepSpeed 0.19.8 on 2 gloo ranks: DeepSpeed's `_SeqAllToAll` and zeroshard's give the same
tensors and gradients (even, uneven and GQA head counts, both layouts), and a GPT with DeepSpeed's
`DistributedAttention` under DeepSpeed's engine with its sequence-parallel mpu trains as the same GPT with
zeroshard's under zeroshard's: losses, gradient norms and parameters, only the import swapped."""

from __future__ import annotations

from typing import Any

import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.parity import Case, ds_config, flat_params, global_batches, micro_batch, param_groups
from helpers.ulysses import ulysses_model

CASE = Case(stage=2, steps=3)
# (batch_dim_idx, shape of one rank's [.., seq/P, heads, head_dim] input, num_kv_heads): even heads, 3 heads over 2
# ranks, and GQA with 6 query heads over 3 key/value heads (DeepSpeed's inverse exchange needs the count given)
EXCHANGES = [
    (0, (2, 4, 4, 3), None),
    (1, (4, 2, 4, 3), None),
    (0, (2, 4, 3, 3), 3),
    (1, (4, 2, 3, 3), 3),
    (0, (2, 4, 6, 3), 3),
]


def _train(deepspeed: Any, rank: int, sp: int) -> dict[str, Any]:
    import torch.distributed as dist

    mpu = deepspeed.runtime.sequence_parallel.parallel_state_sp
    mpu.initialize_sequence_parallel(sp)
    attention = deepspeed.sequence.layer.DistributedAttention
    model = ulysses_model(CASE, mpu.get_sequence_parallel_group(), attention)
    config = ds_config(CASE)
    config["optimizer"]["params"]["eps"] = 1e-6
    config["zero_allow_untested_optimizer"] = True
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model.gpt, CASE), config=config, mpu=mpu
    )
    losses, norms = [], []
    for batch in global_batches(CASE, 1):
        x, y = micro_batch(batch, 0, 0, 1, CASE.micro)
        part = x.shape[1] // sp
        cut = slice(rank * part, (rank + 1) * part)
        loss = engine(x[:, cut], y[:, cut], rank * part, x.numel())
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        norms.append(float(engine.get_global_grad_norm()))
    params = flat_params(engine.module)
    mpu._release_sequence_parallel_groups()
    return {"losses": losses, "norms": norms, "params": params}


def _exchanges(module: Any, group: Any, rank: int) -> list[list[torch.Tensor]]:
    out = []
    for batch_dim, shape, kv in EXCHANGES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
        heads = module._SeqAllToAll.apply(group, x, 2, 1 - batch_dim, batch_dim, None, None, None, True, kv)
        back = module._SeqAllToAll.apply(group, heads, 1 - batch_dim, 2, batch_dim, None, None, None, True, kv)
        weight = torch.randn(heads.shape, generator=torch.Generator().manual_seed(20 + rank))
        (heads * weight).sum().backward()
        out.append([heads.detach(), back.detach(), x.grad])
    return out


def _both(rank: int, world_size: int) -> dict[str, Any]:
    deepspeed = import_deepspeed()
    import_deepspeed("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    import_deepspeed("deepspeed.sequence.layer")

    import zeroshard
    import zeroshard.runtime.sequence_parallel.parallel_state_sp
    import zeroshard.sequence.layer

    deepspeed.init_distributed(dist_backend="gloo")
    ds = _train(deepspeed, rank, world_size)
    ours = _train(zeroshard, rank, world_size)
    # DeepSpeed's uneven exchange asks its groups module for the rank: hand it a sequence-parallel mpu
    mpu = deepspeed.runtime.sequence_parallel.parallel_state_sp
    mpu.initialize_sequence_parallel(world_size)
    deepspeed.utils.groups.mpu = mpu
    group = mpu.get_sequence_parallel_group()
    exchanges = (_exchanges(deepspeed.sequence.layer, group, rank), _exchanges(zeroshard.sequence.layer, group, rank))
    return {"ds": ds, "ours": ours, "exchanges": exchanges}


def test_ulysses_matches_deepspeed_with_the_import_swapped() -> None:
    for rank, run in enumerate(run_on_ranks(_both, 2, timeout=600)):
        ds, ours = run["ds"], run["ours"]
        for step, (a, b) in enumerate(zip(ours["losses"], ds["losses"], strict=True)):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, step, a, b)
        for step, (a, b) in enumerate(zip(ours["norms"], ds["norms"], strict=True)):
            assert abs(a - b) <= 1e-5 * b, (rank, step, a, b)
        diff = float((ours["params"] - ds["params"]).abs().max() / ds["params"].abs().max())
        assert diff <= 1e-6, (rank, diff)
        for case, (theirs, mine) in zip(EXCHANGES, zip(*run["exchanges"], strict=True), strict=True):
            for name, a, b in zip(("to heads", "round trip", "gradient"), mine, theirs, strict=True):
                assert a.shape == b.shape and a.equal(b), (rank, case, name)
