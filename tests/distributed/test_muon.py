"""ds_config `"type": "Muon"` ([Note: Muon on flat shards] in optim/muon.py): stages 0-3 on 2 gloo ranks against a
single process stepping the same Muon optimizer over the model's own parameters (helpers/muon.py), every step, and
against DeepSpeed 0.19.8's Muon; the matrices made whole across ranks (zero/matrices.py, zero/stage3/matrices.py)
give the single process's update bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.muon import PARAMS, muon_config, reference
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    flat_params,
    global_batches,
    micro_batch,
    param_groups,
    ranks_threads,
    relative_difference,
    save_and_resume,
)

# bucket 1000: every matrix of the tiny GPT is cut across both ranks' shards (and across buckets). Without
# clipping and accumulation the gradients are the single process's to the bit, and so is every update.
EXACT = [Case(stage=0, steps=3, clip=0.0), Case(stage=1, steps=3, bucket=1000, clip=0.0)]
EXACT += [Case(stage=2, steps=3, bucket=1000, clip=0.0), Case(stage=3, steps=3, clip=0.0)]
# stage 3: sub-groups of about one block (each stepped alone, every rank), the persistent unit, offload tiers
EXACT += [Case(stage=3, steps=3, clip=0.0, sub_group=3000, persistence=100)]
EXACT += [Case(stage=3, steps=3, clip=0.0, offload="nvme", offload_param="nvme", sub_group=3000)]
# the clipping norm and a window's sum round differently from the single process's: 1e-6 as every fp32 parity test
CLOSE = [
    Case(stage=2, steps=3, bucket=1000, gas=2),
    Case(stage=1, steps=3, offload="cpu"),
    Case(stage=2, steps=3, offload="nvme"),
    Case(stage=3, steps=3, gas=2, offload="cpu", offload_param="cpu"),
]
# bf16 compute, fp32 masters: each rank's bf16 backward sees its own micro-batch, the reference's the whole batch
BF16 = [Case(stage=s, steps=2, dtype="bf16", bucket=1000) for s in (0, 2, 3)]


def _train(rank: int, world_size: int, cases: list[Case], params: dict):
    import zeroshard

    out = []
    for case in cases:
        model = build_model(case)
        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=muon_config(case, params)
        )
        losses, values = [], []
        for batch in global_batches(case, world_size):
            total = 0.0
            for k in range(case.gas):
                x, y = micro_batch(batch, k, rank, world_size, case.micro)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / case.gas
            mean = torch.tensor([total / world_size])
            torch.distributed.all_reduce(mean)
            losses.append(float(mean))
            with zeroshard.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole for the read
                values.append(flat_params(engine.module))
        kinds = sorted({bool(g["use_muon"]) for g in optimizer.param_groups})
        out.append((case.name, losses, values, kinds))
        engine.destroy()
    return out


def test_muon_equals_a_single_process() -> None:
    results = run_on_ranks(_train, 2, EXACT + CLOSE + BF16, PARAMS)
    for i, case in enumerate(EXACT + CLOSE + BF16):
        with ranks_threads():
            want_losses, want_values = reference(case, 2, PARAMS)
        for rank_result in results:
            name, losses, values, kinds = rank_result[i]
            assert kinds == [False, True], name
            for step, (got, want) in enumerate(zip(values, want_values, strict=True)):
                tolerance = 0.0 if case in EXACT else 1e-2 if case in BF16 else 1e-6  # [Note: bf16 tolerance]
                assert relative_difference(got, want) <= tolerance, (name, step, relative_difference(got, want))
            assert losses == pytest.approx(want_losses, rel=1e-2 if case in BF16 else 1e-6), name


def test_muon_changes_the_matrices_differently_from_adam() -> None:
    """The parity above would hold with any whole-matrix step: Muon's matrices move by lr times an orthogonalised
    update (its nonzero singular values near 1)."""
    case = Case(stage=0, steps=1)
    model = build_model(case)
    before = copy.deepcopy(model)
    reference_losses, values = reference(case, 1, PARAMS)
    assert reference_losses
    torch.nn.utils.vector_to_parameters(values[-1], model.parameters())
    weight = dict(model.named_parameters())["blocks.0.mlp.0.weight"]
    start = dict(before.named_parameters())["blocks.0.mlp.0.weight"]
    # W1 = W0 (1 - lr wd) - lr O  =>  O = (W0 (1 - lr wd) - W1) / lr
    lr, wd = PARAMS["lr"], PARAMS["weight_decay"]
    update = (start.detach() * (1 - lr * wd) - weight.detach()) / lr
    singular = torch.linalg.svdvals(update / max(1.0, (weight.shape[0] / weight.shape[1]) ** 0.5))
    # a layer-normed input spans 31 of its 32 directions: that one stays 0, the others come out near 1 (NS5's range)
    kept = singular[singular > 1e-3]
    assert len(kept) >= 30 and 0.5 < float(kept.min()) and float(kept.max()) < 1.3, singular


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"zeroshard": {"backend": "fsdp2"}}, "fsdp2"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "master weights"),
        ({"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}}, "per_head_muon"),
        ({"optimizer": {"type": "Muon", "params": {"nesterov": False}}}, "optimizer.params.nesterov"),
        ({"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}}, "ns_method"),
    ],
)
def test_muon_refusals_name_the_key(extra: dict, message: str) -> None:
    from zeroshard.config import parse_config, resolve_config
    from zeroshard.errors import ConfigError

    config = muon_config(EXACT[1], PARAMS)
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if key != "optimizer" else value
    with pytest.raises(ConfigError, match=message):
        resolve_config(parse_config(config), world_size=2)  # what initialize runs before any work


RESUMES = [
    (Case(stage=2, steps=4, clip=0.0), Case(stage=1, steps=4, bucket=1000, clip=0.0)),
    (Case(stage=3, steps=4, clip=0.0, sub_group=3000), Case(stage=2, steps=4, clip=0.0)),
]


def _resume(rank: int, world_size: int, directory: str, params: dict, saver: Case, loader: Case):
    """The momentum and the Adam half's state come back into another layout."""
    return save_and_resume(rank, world_size, directory, saver, loader, lambda case: muon_config(case, params))


@pytest.mark.parametrize("saver, loader", RESUMES, ids=lambda case: f"stage{case.stage}")
def test_muon_state_resumes_in_another_layout(tmp_path, saver: Case, loader: Case) -> None:
    for continued, resumed in run_on_ranks(_resume, 2, str(tmp_path), PARAMS, saver, loader):
        for got, want in zip(resumed, continued, strict=True):
            assert torch.equal(got, want), (got - want).abs().max().item()


# DeepSpeed 0.19.8's own Muon engine on the same ranks. Without clipping its stages 0-3 update as ours to the bit on an
# AVX-512 CPU (its stage 2 with a window of two micro-steps to rounding); on an AVX2 one (AMD EPYC, 2026-11-30) within
# 1e-6 (6e-8 after the first step, 2e-7 after the second: the matrix products round apart there). With clipping its
# stages 1-3 differ by design: their norm counts the orthogonalised updates where the gradients stood ([Note: Muon on
# flat shards]); stage 0 agrees.
DEEPSPEED_CASES = [
    (Case(stage=0, steps=3, clip=0.0), 1e-6),
    (Case(stage=1, steps=3, bucket=1000, clip=0.0), 1e-6),
    (Case(stage=2, steps=3, bucket=1000, clip=0.0), 1e-6),
    (Case(stage=0, steps=3, clip=1.0), 1e-6),
    (Case(stage=2, steps=3, gas=2, clip=0.0), 1e-6),
    (Case(stage=3, steps=3, clip=0.0, reduce_scatter=False), 1e-6),  # DeepSpeed's stage 3 refuses Muon otherwise
]


def _both(rank: int, world_size: int, params: dict):
    import zeroshard

    torch._dynamo.config.disable = True  # DeepSpeed wraps its Newton-Schulz in torch.compile: minutes on this CPU
    runs = []
    for library in (zeroshard, import_deepspeed()):
        if library is not zeroshard:
            library.init_distributed(dist_backend="gloo")
        for case, _ in DEEPSPEED_CASES:
            model = build_model(case)
            engine, *_ = library.initialize(
                model=model, model_parameters=param_groups(model, case), config=muon_config(case, params)
            )
            values = []
            for batch in global_batches(case, world_size):
                for k in range(case.gas):
                    engine.backward(engine(*micro_batch(batch, k, rank, world_size, case.micro)))
                    engine.step()
                with library.zero.GatheredParameters(list(engine.module.parameters())):
                    values.append(flat_params(engine.module))
            runs.append(values)
            engine.destroy()
    return runs


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by Muon:
# test_muon_equals_a_single_process
@pytest.mark.slow
def test_muon_trains_as_deepspeeds() -> None:
    for runs in run_on_ranks(_both, 2, PARAMS, timeout=900):
        ours, theirs = runs[: len(DEEPSPEED_CASES)], runs[len(DEEPSPEED_CASES) :]
        for (case, tolerance), mine, deepspeeds in zip(DEEPSPEED_CASES, ours, theirs, strict=True):
            for step, (got, want) in enumerate(zip(mine, deepspeeds, strict=True)):
                assert relative_difference(got, want) <= tolerance, (case.name, case.clip, step)


def _switch(rank: int, world_size: int, directory: str, params: dict, first: str, stage: int):
    """Train with `first` ("Muon" or "AdamW"), save, load into the other optimizer: [Note: optimizer state of another
    kind] in checkpoint/load.py."""
    import zeroshard

    case = Case(stage=stage, steps=3, clip=0.0)
    batches = global_batches(case, world_size)
    out = []
    for optimizer_type in (first, "AdamW" if first == "Muon" else "Muon"):
        model = build_model(case)
        config = muon_config(case, params) if optimizer_type == "Muon" else ds_config(case)
        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=config
        )
        if optimizer_type != first:
            engine.load_checkpoint(directory)
        with zeroshard.GatheredParameters(list(engine.module.parameters())):
            loaded = flat_params(engine.module)
        steps = 2 if optimizer_type == first else 1
        for batch in batches[:steps]:
            engine.backward(engine(*micro_batch(batch, 0, rank, world_size, case.micro)))
            engine.step()
        if optimizer_type == first:
            engine.save_checkpoint(directory)
        with zeroshard.GatheredParameters(list(engine.module.parameters())):
            values = flat_params(engine.module)
        kinds = [
            (bool(g.get("use_muon")), g["lr"], sorted({k for p in g["params"] for k in optimizer.state.get(p, {})}))
            for g in optimizer.param_groups
        ]
        out.append((loaded, values, kinds))
        engine.destroy()
    return out


@pytest.mark.parametrize("first", ["Muon", "AdamW"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_the_other_optimizer_loads_its_weights_and_starts_its_state_fresh(
    tmp_path, first: str, stage: int
) -> None:
    for (_, saved, _), (loaded, _, kinds) in run_on_ranks(_switch, 2, str(tmp_path), PARAMS, first, stage):
        assert torch.equal(loaded, saved)
        for use_muon, lr, keys in kinds:  # one step after the load: each group's own kind of state and lr
            if use_muon:
                assert keys == ["momentum_buffer"] and lr == PARAMS["lr"], (use_muon, lr, keys)
            else:
                assert keys == ["exp_avg", "exp_avg_sq", "step"], (use_muon, lr, keys)


def _with_sequence_mpu(rank: int, world_size: int, params: dict) -> str:
    import zeroshard
    from helpers.ulysses import ulysses_model
    from zeroshard.errors import ConfigError
    from zeroshard.runtime.sequence_parallel import parallel_state_sp

    case = Case(stage=2, steps=1)
    model = ulysses_model(case)
    zeroshard.init_distributed(dist_backend="gloo")
    parallel_state_sp.initialize_sequence_parallel(2)  # the size arrives with the mpu, after the config's checks
    with pytest.raises(ConfigError, match="sequence parallelism") as refused:
        zeroshard.initialize(
            model=model,
            model_parameters=param_groups(model.gpt, case),
            config=muon_config(case, params),
            mpu=parallel_state_sp,
        )
    return str(refused.value)


def test_muon_refuses_sequence_parallelism_from_an_mpu() -> None:
    assert all("Muon" in message for message in run_on_ranks(_with_sequence_mpu, 2, PARAMS))


def _train_in_batches(rank: int, world_size: int, cases: list[Case], params: dict, batch_numel: int):
    from zeroshard.zero import matrices

    matrices.BATCH_NUMEL = batch_numel  # [Note: Muon's exchange in batches]: one exchange per matrix or two
    return _train(rank, world_size, cases, params)


def test_muon_exchanged_in_small_batches_is_unchanged() -> None:
    cases = [EXACT[1], EXACT[3]]  # stages 1 and 3
    for rank_result in run_on_ranks(_train_in_batches, 2, cases, PARAMS, 2500):
        for case, (name, _, values, _) in zip(cases, rank_result, strict=True):
            with ranks_threads():
                _, want_values = reference(case, 2, PARAMS)
            assert all(torch.equal(got, want) for got, want in zip(values, want_values, strict=True)), name


def _momentum_in_memory(rank: int, world_size: int, params: dict, directory: str) -> dict:
    """Stage 3 with the optimizer state on NVMe, with and without save_muon_momentum_buffer_in_memory."""
    import zeroshard

    case = Case(stage=3, steps=3, clip=0.0, offload="nvme", sub_group=3000)
    out: dict = {}
    for keep in (False, True):
        model = build_model(case)
        config = muon_config(case, params)
        config["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = keep
        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=config
        )
        losses = []
        for batch in global_batches(case, world_size):
            loss = engine(*micro_batch(batch, 0, rank, world_size, case.micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        # between steps: what is in memory (storage bytes) of each kind of state
        held: dict[str, int] = {}
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    held[key] = held.get(key, 0) + value.untyped_storage().nbytes()
        engine.save_checkpoint(directory, tag=f"keep{keep}")
        report = engine.memory_report()
        out[keep] = (losses, held, report.nvme_bytes, report.host_optimizer_state)
        engine.destroy()
    # each save resumes under the other setting: the momentum is in the checkpoint either way
    for saved, keep in ((True, False), (False, True)):
        model = build_model(case)
        config = muon_config(case, params)
        config["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = keep
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        engine.load_checkpoint(directory, tag=f"keep{saved}")
        loss = engine(*micro_batch(global_batches(case, world_size)[0], 0, rank, world_size, case.micro))
        engine.backward(loss)
        engine.step()
        with zeroshard.GatheredParameters(list(engine.module.parameters())):
            out[f"resumed{saved}"] = (loss.item(), flat_params(engine.module))
        engine.destroy()
    return out


def test_save_muon_momentum_buffer_in_memory_keeps_it_off_nvme(tmp_path) -> None:
    """zero_optimization.save_muon_momentum_buffer_in_memory (DeepSpeed's, stage 3): the Muon matrices' momentum stays
    in host memory between steps while the masters and the Adam half's moments are on NVMe; the NVMe files hold
    that much less; the training is the same to the bit."""
    for out in run_on_ranks(_momentum_in_memory, 2, PARAMS, str(tmp_path)):
        (swapped_losses, swapped, swapped_nvme, swapped_host), (kept_losses, kept, kept_nvme, kept_host) = (
            out[False],
            out[True],
        )
        assert kept_losses == swapped_losses
        assert swapped["momentum_buffer"] == 0 and swapped["exp_avg"] == 0  # all on NVMe between steps
        assert kept["momentum_buffer"] > 0 and kept["exp_avg"] == 0
        assert swapped_nvme - kept_nvme == kept["momentum_buffer"], (swapped_nvme, kept_nvme, kept)
        assert kept_host - swapped_host == kept["momentum_buffer"], (kept_host, swapped_host)  # memory_report counts it
        assert out["resumedTrue"][0] == out["resumedFalse"][0]
        assert torch.equal(out["resumedTrue"][1], out["resumedFalse"][1])
