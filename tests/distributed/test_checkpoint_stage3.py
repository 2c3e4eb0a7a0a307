"""Stage 3 resumes bit-for-bit also with a persistent unit and units kept gathered for reuse (the
gathered copies are refreshed after a load, which fills shards only)."""

from __future__ import annotations

from typing import Any

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _run(rank: int, world_size: int, root: str, resume: bool):
    import zeroshard

    case = Case(stage=3, steps=6, persistence=2000, reuse=10**9, prefetch=10**9)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    batches = global_batches(case, world_size)
    start = 0
    if resume:
        engine.load_checkpoint(root)
        start = 3
    losses = []
    for step in range(start, 6):
        x, y = micro_batch(batches[step], 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if not resume and step == 2:
            engine.save_checkpoint(root)
    engine.destroy()
    return losses


def test_stage3_resume_with_persistent_and_reused_units(tmp_path):
    before = run_on_ranks(_run, 2, str(tmp_path), False)
    after = run_on_ranks(_run, 2, str(tmp_path), True)
    for rank in range(2):
        assert after[rank] == before[rank][3:], (rank, before[rank], after[rank])


def _train(rank: int, world_size: int, case, root: str, start: int, save_at: int | None) -> tuple[list[float], Any]:
    import zeroshard

    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    if start:
        engine.load_checkpoint(root)
    batches = global_batches(case, world_size)
    losses = []
    for step in range(start, case.steps):
        x, y = micro_batch(batches[step], 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == save_at:
            engine.save_checkpoint(root)
    report = engine.memory_report()
    engine.destroy()
    return losses, report


def _across_ratios(rank: int, world_size: int, root: str) -> dict[float, tuple[list[float], Any]]:
    def case(ratio: float) -> Case:
        return Case(stage=3, steps=6, offload="cpu", sub_group=1000, ratio=ratio)

    out = {0.5: _train(rank, world_size, case(0.5), root, 0, save_at=2)}
    for ratio in (1.0, 0.0):  # all on the host, all on the device
        out[ratio] = _train(rank, world_size, case(ratio), root, 3, save_at=None)
    return out


def test_partial_offload_checkpoint_resumes_with_any_split(tmp_path):
    """[Note: partial offload]: the checkpoint holds no placement; a run saved with half of the optimizer state on
    the host resumes bit-for-bit with all of it on the host or all on the device."""
    for runs in run_on_ranks(_across_ratios, 2, str(tmp_path)):
        (saved, split), (on_host, host_only), (on_device, device_only) = runs[0.5], runs[1.0], runs[0.0]
        assert on_host == saved[3:] and on_device == saved[3:], runs
        assert split.optimizer_state > 0 and split.host_optimizer_state > 0, split
        assert host_only.optimizer_state == 0 and device_only.host_optimizer_state == 0, (host_only, device_only)
