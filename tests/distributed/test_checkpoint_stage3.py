"""Stage 3 resumes bit-for-bit also with a persistent unit and units kept gathered for reuse (the
gathered copies are refreshed after a load, which fills shards only)."""

from __future__ import annotations

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
