"""A sequence-parallel run's checkpoint ([Note: sequence parallelism]): ZeRO state sharded over every rank, nothing
sequence-specific in it. Saved after 2 of 4 steps on 2 ranks splitting each sequence, loaded into a fresh engine
(a model built with another seed), the last 2 steps give the uninterrupted run's losses and parameters bit for bit,
at stages 2 and 3; the consolidated fp32 export equals the parameters at the save; and the checkpoint loads into a
2-rank run without sequence parallelism (a ZeRO checkpoint over the same world), whose parameters are the save's."""

from __future__ import annotations

import os
from typing import Any

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, ds_config, flat_params, global_batches, micro_batch, param_groups
from helpers.ulysses import ulysses_model

STAGES = [2, 3]
SAVE_AT = 2


def _engine(case: Case, sp: int, seed_shift: int = 0) -> Any:
    import zeroshard

    if seed_shift:  # a model that starts elsewhere: only the checkpoint can make it the saved one
        torch.manual_seed(seed_shift)
    model = ulysses_model(case)
    if seed_shift:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    config = {**ds_config(case), **({"sequence_parallel_size": sp} if sp > 1 else {})}
    return zeroshard.initialize(model=model, model_parameters=param_groups(model.gpt, case), config=config)[0]


def _steps(engine: Any, rank: int, case: Case, first: int, last: int) -> tuple[list[float], list[torch.Tensor]]:
    losses, params = [], []
    batches = global_batches(case, 1)
    for step in range(first, last):
        x, y = micro_batch(batches[step], 0, 0, 1, case.micro)
        part = x.shape[1] // 2
        cut = slice(rank * part, (rank + 1) * part)
        loss = engine(x[:, cut], y[:, cut], rank * part, x.numel())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    return losses, params


def _phase(rank: int, world_size: int, root: str) -> dict[int, dict[str, Any]]:
    from zeroshard.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for stage in STAGES:
        case = Case(stage=stage, steps=4)
        path = os.path.join(root, f"stage{stage}")
        engine = _engine(case, 2)
        whole = _steps(engine, rank, case, 0, case.steps)
        engine.destroy()
        engine = _engine(case, 2)
        first = _steps(engine, rank, case, 0, SAVE_AT)
        engine.save_checkpoint(path)
        engine.destroy()
        engine = _engine(case, 2, seed_shift=17)
        engine.load_checkpoint(path)
        resumed = _steps(engine, rank, case, SAVE_AT, case.steps)
        engine.destroy()
        exported = get_fp32_state_dict_from_zero_checkpoint(path)
        engine = _engine(case, 1, seed_shift=23)  # the same world, no sequence parallelism
        engine.load_checkpoint(path)
        with engine.gathered_for_generation():
            plain = flat_params(engine.module)
        engine.destroy()
        names = [n for n, _ in ulysses_model(case).named_parameters()]
        export = torch.cat([exported[n].reshape(-1) for n in names])
        out[stage] = {"whole": whole, "first": first, "resumed": resumed, "export": export, "plain": plain}
    return out


def test_sequence_parallel_checkpoint_resumes_bit_for_bit(tmp_path: Any) -> None:
    for rank, runs in enumerate(run_on_ranks(_phase, 2, str(tmp_path), timeout=600)):
        for stage, run in runs.items():
            whole_losses, whole_params = run["whole"]
            first_losses, first_params = run["first"]
            resumed_losses, resumed_params = run["resumed"]
            assert first_losses + resumed_losses == whole_losses, (rank, stage)
            assert all(a.equal(b) for a, b in zip(first_params + resumed_params, whole_params, strict=True))
            assert run["export"].equal(first_params[-1]), (rank, stage)
            assert run["plain"].equal(first_params[-1]), (rank, stage)
