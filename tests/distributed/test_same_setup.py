"""[Note: ranks given different setups]: ranks given another config or model are refused in `initialize`, every rank
with the same line, before any collective of the engine (a stage that differs waited out the deadline; a parameter
shape that differs aborted inside gloo; an lr that differs trained on, the replicas drifting apart)."""

from __future__ import annotations

from helpers.harness import run_on_ranks


def _given(rank: int, world_size: int, what: str) -> str:
    import torch
    from torch import nn

    import zeroshard

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    config["zero_optimization"] = {"stage": 3 if what == "stage" and rank == 1 else 2}
    if what == "nvme_path":  # one drive per GPU: the paths differ by design; rank 0 alone reads a monitor's name
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "nvme_path": f"/nvme{rank}"}
        config["csv_monitor"] = {"enabled": False, "job_name": f"run_{rank}"}
    width = 5 if what == "shape" and rank == 1 else 4
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, width))
    try:
        engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    except zeroshard.ConfigError as error:
        return str(error)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.destroy()
    return "trained"


def test_ranks_given_another_config_or_model_are_refused_naming_where() -> None:
    for what, said in (
        ("stage", "rank 1 was given another ds_config than rank 0: zero_optimization.stage: 2 on rank 0, 3 on rank 1"),
        ("shape", "rank 1 was given another model (parameter name: shape dtype) than rank 0: 1.bias: (4,) float32"),
        ("nvme_path", "trained"),
    ):
        for message in run_on_ranks(_given, 2, what):
            assert message.startswith(said), (what, message)
