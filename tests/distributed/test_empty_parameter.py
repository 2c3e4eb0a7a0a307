"""A trainable parameter of no elements (a zero-width LoRA rank, an empty bias) is saved without pieces: loading the
checkpoint said "the checkpoint has no model data for 'e'" at stage 0, and `zeroshard convert` ended in a KeyError;
a frozen one (stages 0-2) or an empty buffer (every stage) failed the save ("every tensor is already written")."""

from __future__ import annotations

import os

from helpers.harness import run_on_ranks


def _save_load_export(rank: int, world_size: int, folder: str) -> list[str]:
    import torch

    import zeroshard
    from zeroshard.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    out = []
    for stage in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model.empty = torch.nn.Parameter(torch.zeros(0))
        model.empty_frozen = torch.nn.Parameter(torch.zeros(0), requires_grad=False)
        model.register_buffer("empty_buffer", torch.zeros(0))
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        engine.backward(engine(torch.ones(1, 4)).sum() + model.empty.sum())
        engine.step()
        path = os.path.join(folder, f"s{stage}")
        engine.save_checkpoint(path, tag="t")
        engine.load_checkpoint(path, tag="t")
        files = convert_zero_checkpoint_to_state_dict(path, os.path.join(folder, f"hf{stage}"), tag="t")
        out.append(f"stage {stage}: loaded, exported {files}")
        engine.destroy()
    return out


def test_an_empty_parameter_saves_loads_and_exports(tmp_path) -> None:
    (got,) = run_on_ranks(_save_load_export, 1, str(tmp_path))
    assert got == [f"stage {s}: loaded, exported ['model.safetensors']" for s in (0, 3)], got
