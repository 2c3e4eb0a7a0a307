"""The bytes a save announces before writing ([Note: checkpoint space]: what the free-space check compares) against
the bytes it then writes, with fp32 and with bf16 masters and optimizer state ([Note: bf16 master weights])."""

from __future__ import annotations

import os
import tempfile

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

CASES = [
    Case(stage=3),
    Case(stage=3, dtype="bf16", master="bf16", state="bf16"),  # every state tensor in bf16: 2 bytes, not 4
    Case(stage=1, dtype="bf16", master="bf16", state="fp32"),
]


def _announced_and_written(rank: int, world_size: int, root: str) -> list[tuple[int, int]]:
    import torch.distributed as dist

    import zeroshard
    import zeroshard.checkpoint.save as save_module
    from zeroshard.checkpoint.space import bytes_to_write

    out = []
    for i, case in enumerate(CASES):
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        batch = global_batches(case, world_size)[0]
        engine.backward(engine(*micro_batch(batch, 0, rank, world_size, case.micro)))
        engine.step()  # the optimizer state exists
        announced = [0] * world_size
        dist.all_gather_object(announced, bytes_to_write(engine, save_module.engine_state(engine)))
        engine.save_checkpoint(root, tag=f"case{i}")
        engine.destroy()
        folder = os.path.join(root, f"case{i}")
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
        out.append((sum(announced), written))
    return out


def test_a_save_announces_what_it_writes() -> None:
    """The tensors' bytes, within the files' headers, manifests and the engine state (small): neither the 2x of
    counting bf16 state as fp32 (which refused saves that fit) nor less than the tensors."""
    with tempfile.TemporaryDirectory() as root:
        results = run_on_ranks(_announced_and_written, 2, root, timeout=300)[0]
    for case, (announced, written) in zip(CASES, results, strict=True):
        assert announced <= written <= 1.05 * announced + 256 * 1024, (case.name, announced, written)
