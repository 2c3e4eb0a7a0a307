"""Ulysses sequence parallelism ([Note: sequence parallelism]): a GPT whose attention is `DistributedAttention`,
each sample's sequence split over P ranks, trains as the single-process reference does on whole sequences (same
seed, same global batch): losses, gradient norms (the sum over a sample's ranks, the mean over replicas) and
parameters every step, at stages 1-3, from the config keys and from DeepSpeed's sequence-parallel mpu.

Adam's eps is 1e-6 here (1e-8 by default): a rank sums its part of a sequence and the parts are added, where the
reference sums the whole sequence in one product, so gradients differ in their last bits, and elements whose true
gradient is near zero (a key's weight seen by the first query only) are normalised by Adam into lr-sized steps of
either sign. With eps 1e-6 such rounding stays rounding; the gradient norms are compared directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    flat_params,
    global_batches,
    micro_batch,
    param_groups,
    traced_reference,
)
from helpers.ulysses import ulysses_model

EPS = 1e-6
CASES = [
    (Case(stage=1, gas=2, steps=4), "config", {}),
    (Case(stage=2, steps=4), "mpu", {}),
    (Case(stage=3, steps=4), "config", {}),
    (Case(stage=2, steps=4), "config", {"zeroshard": {"backend": "fsdp2"}}),
]


def reference(case: Case, replicas: int) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Per-step mean loss, gradient norm (before clipping) and parameters of plain PyTorch on whole sequences."""
    model = build_model(case)
    return traced_reference(model, param_groups(model, case), case, replicas, EPS)


def train(rank: int, world_size: int, case: Case, source: str, sp: int, extra: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import groups

    model = ulysses_model(case)
    config = {**ds_config(case), **extra}
    config["optimizer"]["params"]["eps"] = EPS
    mpu = None
    if source == "mpu":
        from zeroshard.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(sp)
        mpu = parallel_state_sp
    else:
        config["sequence_parallel_size"] = sp
    samples = torch.utils.data.TensorDataset(torch.arange(64))  # the engine's loader: a sample's ranks read alike
    engine, _, loader, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model.gpt, case), config=config, mpu=mpu, training_data=samples
    )
    replicas, sp_rank = world_size // sp, rank % sp
    seq_group = engine.seq_parallel_group
    losses, norms, params = [], [], []
    for batch in global_batches(case, replicas):
        step_loss = torch.zeros(())
        for k in range(case.gas):
            x, y = micro_batch(batch, k, rank // sp, replicas, case.micro)
            part = x.shape[1] // sp
            cut = slice(sp_rank * part, (sp_rank + 1) * part)
            loss = engine(x[:, cut], y[:, cut], sp_rank * part, x.numel())
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / (replicas * case.gas)
        dist.all_reduce(step_loss)  # the parts of every sample, every replica's mean
        losses.append(float(step_loss))
        norms.append(engine.get_global_grad_norm())
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    facts = {
        "train_batch_size": engine.train_batch_size(),
        "dp_world_size": engine.dp_world_size,
        "seq_dp_world_size": engine.seq_dp_world_size,
        "sp_ranks": dist.get_process_group_ranks(seq_group),
        "groups_sp": (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()),
        "groups_dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "dp_group_ranks": dist.get_process_group_ranks(groups._get_data_parallel_group()),
        "groups_sdp": groups._get_sequence_data_parallel_world_size(),
        "first_batch": next(iter(loader))[0].tolist(),
        "all_to_all": engine.comm_stats.snapshot()["all_to_all"]["calls"],
        "reduce_scatter_bytes": engine.comm_stats.snapshot()["reduce_scatter"]["bus_bytes"],
    }
    engine.destroy()
    if mpu is not None:
        mpu._release_sequence_parallel_groups()
    return {"losses": losses, "norms": norms, "params": params, **facts}


def _check(case: Case, run: dict[str, Any], ref: tuple[list[float], list[float], list[torch.Tensor]]) -> None:
    ref_losses, ref_norms, ref_params = ref
    for step, (loss, ref_loss) in enumerate(zip(run["losses"], ref_losses, strict=True)):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (case, step, loss, ref_loss)
    for step, (norm, ref_norm) in enumerate(zip(run["norms"], ref_norms, strict=True)):
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (case, step, norm, ref_norm)
    for step, (p, ref_p) in enumerate(zip(run["params"], ref_params, strict=True)):
        diff = float((p - ref_p).abs().max() / ref_p.abs().max())
        assert diff <= 1e-6, (case, step, diff)


def _two_ranks(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [train(rank, world_size, case, source, 2, extra) for case, source, extra in CASES]


def test_ulysses_trains_as_whole_sequences_on_one_process() -> None:
    runs = run_on_ranks(_two_ranks, 2, timeout=600)
    for i, (case, _, _) in enumerate(CASES):
        ref = reference(case, 1)
        for rank in range(2):
            run = runs[rank][i]
            _check(case, run, ref)
            assert run["train_batch_size"] == case.micro * case.gas  # one replica
            assert (run["dp_world_size"], run["seq_dp_world_size"], run["sp_ranks"]) == (1, 2, [0, 1])
            assert run["groups_sp"] == (2, rank) and run["groups_dp"] == (1, 0) and run["groups_sdp"] == 2
            assert run["dp_group_ranks"] == [rank]  # the replicas' group itself, of one rank, not the world
            # q, k, v and the output: four all-to-alls per layer forward, four backward
            assert run["all_to_all"] == 8 * 2 * case.gas * case.steps, run["all_to_all"]
        assert runs[0][i]["params"][-1].equal(runs[1][i]["params"][-1])
        assert runs[0][i]["first_batch"] == runs[1][i]["first_batch"]


# dp2 x sp2: the divisor is the 2 replicas, not the 4 ranks, whichever scaling the config asks for
FOUR_RANK_CASES = [
    (Case(stage=2, steps=3), {"data_parallel_size": 2}),
    (Case(stage=0, steps=2), {"prescale_gradients": True}),
    (Case(stage=1, steps=2), {"gradient_predivide_factor": 2.0}),
]


class _StridedMpu:
    """A sequence-parallel mpu whose groups are not consecutive ranks ({0, 2}, {1, 3})."""

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist

        made = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.group = made[rank % 2]

    def initialize_sequence_parallel(self, size: int) -> None:
        raise AssertionError("made already")

    def get_sequence_parallel_group(self) -> Any:
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return 2


def _four_ranks(rank: int, world_size: int) -> tuple[list[dict[str, Any]], str]:
    import zeroshard
    from zeroshard.errors import ConfigError

    runs = [train(rank, world_size, case, "config", 2, extra) for case, extra in FOUR_RANK_CASES]
    try:
        zeroshard.initialize(model=ulysses_model(Case(stage=2)), config=ds_config(Case(stage=2)), mpu=_StridedMpu(rank))
        refused = "no error"
    except ConfigError as error:
        refused = str(error)
    return runs, refused


def test_ulysses_with_two_replicas_sums_over_the_sample_and_averages_over_replicas() -> None:
    per_rank = run_on_ranks(_four_ranks, 4, timeout=600)
    for i, (case, _) in enumerate(FOUR_RANK_CASES):
        ref = reference(case, 2)
        runs = [runs[i] for runs, _ in per_rank]
        for rank, run in enumerate(runs):
            _check(case, run, ref)
            assert run["train_batch_size"] == 2 * case.micro
            assert run["sp_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
            assert run["groups_dp"] == (2, rank // 2) and run["groups_sdp"] == 4
            assert run["dp_group_ranks"] == [rank % 2, rank % 2 + 2]
        batches = [run["first_batch"] for run in runs]
        assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2], batches
    assert all("needs consecutive blocks of 2 ranks" in refused for _, refused in per_rank), per_rank[0][1]


def _gradient_bytes(rank: int, world_size: int) -> list[float]:
    sent = []
    for extra in ({}, {"seq_parallel_communication_data_type": "bf16"}, {"communication_data_type": "bf16"}):
        run = train(rank, world_size, Case(stage=2, dtype="bf16", steps=1, clip=0.0), "config", 2, extra)
        sent.append(run["reduce_scatter_bytes"])
    return sent


def test_gradients_travel_in_seq_parallel_communication_data_type() -> None:
    """fp32 by default whatever the training dtype (DeepSpeed's default), not `communication_data_type`."""
    for default, bf16, comm_bf16 in run_on_ranks(_gradient_bytes, 2, timeout=600):
        assert default > 0 and default == 2 * bf16 and comm_bf16 == default, (default, bf16, comm_bf16)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sequence_parallel_size": 3}, "does not divide the world size 2"),
        ({"sequence_parallel_size": 2, "data_parallel_size": 2}, "data_parallel_size=2 x sequence_parallel_size=2"),
        ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, "with tensor parallelism"),
        ({"sequence_parallel_size": 2, "model": "pipeline"}, "with a PipelineModule"),
        ({"sequence_parallel_size": 2, "model": "moe"}, "with MoE layers of ep_size > 1"),
    ],
)
def test_bad_sequence_parallel_settings_fail_before_any_work(extra: dict[str, Any], message: str) -> None:
    errors = run_on_ranks(_refused, 2, extra, timeout=300)
    assert all(message in e for e in errors), errors


def _refused(rank: int, world_size: int, extra: dict[str, Any]) -> str:
    import zeroshard
    from zeroshard.errors import ConfigError

    case = Case(stage=2)
    kind = extra.pop("model", "gpt")
    model: torch.nn.Module = ulysses_model(case)
    if kind == "pipeline":
        model = zeroshard.pipe.PipelineModule(
            layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2, loss_fn=torch.nn.MSELoss()
        )
    elif kind == "moe":
        from zeroshard.moe.layer import MoE

        zeroshard.init_distributed()  # MoE layers are built after it, as DeepSpeed's
        model = torch.nn.Sequential(MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=2))
    try:
        zeroshard.initialize(model=model, config={**ds_config(case), **extra})
    except ConfigError as error:
        return str(error)
    return "no error"
