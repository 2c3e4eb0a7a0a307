"""DeepSpeed's engine API on 2 ranks: client objects, dataloader, no_sync, accessors, destroy."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _client_objects(rank: int, world_size: int):
    """A client optimizer and scheduler objects are used (re-pointed at the shards), not rebuilt; `initialize`
    returns DeepSpeed's `engine.optimizer`, a view around it ([Note: the engine's optimizer])."""
    import zeroshard

    case = Case(stage=1, steps=4)
    model = build_model(case)
    opt = torch.optim.AdamW(param_groups(model, case), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    config = {k: v for k, v in ds_config(case).items() if k != "optimizer"}
    engine, optimizer, _, lr_scheduler = zeroshard.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=config
    )
    assert optimizer is engine.optimizer and optimizer.optimizer is opt is engine.basic_optimizer
    assert lr_scheduler is sched and optimizer.param_groups is opt.param_groups and optimizer.state is opt.state
    lrs = []
    for batch in global_batches(case, world_size):
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr())
    api = (
        engine.global_steps,
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        engine.get_global_grad_norm() is not None,
        len(opt.param_groups),
    )
    refused = []
    try:  # the engine's step also reduces, clips and steps the scheduler: stepping the optimizer alone is refused
        optimizer.step()
    except zeroshard.ZeroshardError as e:
        refused.append(str(e))
    try:  # every rank holds the whole model at stage 1: DeepSpeed's ValueError
        engine._consolidated_16bit_state_dict()
    except ValueError as e:
        refused.append(str(e))
    # DeepSpeed-Chat's and OpenRLHF's save at stages 0-2: each tensor its own storage (a parameter here is a view of
    # the flat buffer, and torch.save would write the whole buffer under it)
    state = engine.module.state_dict()
    lean = zeroshard.checkpoint.utils.clone_tensors_for_torch_save(state)
    own = [v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in lean.values()]
    refused.append((all(own), all(torch.equal(lean[k], v) for k, v in state.items()), len(own) > 1))
    refused.append(any(v.untyped_storage().nbytes() > v.numel() * v.element_size() for v in state.values()))
    engine.destroy()
    try:
        optimizer.zero_grad()
    except zeroshard.ZeroshardError as e:
        refused.append(str(e))
    return lrs, api + (refused,)


def _callable_optimizer_and_dataloader(rank: int, world_size: int):
    from torch.utils.data import TensorDataset

    import zeroshard

    case = Case(stage=2, steps=2)
    model = build_model(case)
    data = torch.randint(0, 64, (40, 17))
    dataset = TensorDataset(torch.arange(40), data[:, :-1], data[:, 1:])
    config = {k: v for k, v in ds_config(case).items() if k != "optimizer"}
    engine, optimizer, loader, _ = zeroshard.initialize(
        model=model,
        optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1),
        training_data=dataset,
        config=config,
    )
    assert isinstance(optimizer.optimizer, torch.optim.SGD)
    seen = []
    for index, x, y in loader:
        assert x.shape[0] == case.micro
        seen.extend(index.tolist())
        engine.backward(engine(x, y))
        engine.step()
    engine.destroy()
    return len(loader), sorted(seen)


def _no_sync_and_destroy(rank: int, world_size: int):
    """no_sync accumulates without communication; the next synced backward reduces the sum."""
    import zeroshard

    results = []
    for use_no_sync in (True, False):
        case = Case(stage=1, steps=1, clip=0.0)
        model = build_model(case)
        config = ds_config(case)
        config["gradient_clipping"] = 0.0
        # no_sync sums two micro-batches (loss / 1 each); gas=2 averages them (loss / 2): double its lr
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1 if use_no_sync else 0.2}}
        config["gradient_accumulation_steps"] = 1 if use_no_sync else 2
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        big = Case(stage=1, steps=1, gas=2)
        batch = global_batches(big, world_size)[0]
        x0, y0 = micro_batch(batch, 0, rank, world_size, case.micro)
        x1, y1 = micro_batch(batch, 1, rank, world_size, case.micro)
        if use_no_sync:
            with engine.no_sync():
                before = engine.comm_stats.total_bus_bytes
                engine.backward(engine(x0, y0))
                assert engine.comm_stats.total_bus_bytes == before, "no_sync backward communicated"
            engine.backward(engine(x1, y1))
            engine.step()
        else:
            engine.backward(engine(x0, y0))
            engine.step()
            engine.backward(engine(x1, y1))
            engine.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
        engine.destroy()
        hooks_left = [n for n, p in model.named_parameters() if getattr(p, "_post_accumulate_grad_hooks", None)]
        assert not hooks_left, f"hooks left after destroy: {hooks_left}"
    return float((results[0] - results[1]).abs().max())


def _stage2_rejects_no_sync(rank: int, world_size: int):
    import zeroshard

    case = Case(stage=2, steps=1)
    model = build_model(case)
    engine, _, _, _ = zeroshard.initialize(model=model, config=ds_config(case))
    try:
        with engine.no_sync():
            pass
    except zeroshard.ZeroshardError as err:
        return str(err)
    finally:
        engine.destroy()
    return None


class _WithExtras(torch.nn.Module):
    """DeepSpeed's TestZero3ClientModuleID / TestDSInitWZinit models: an attribute and a method of the user's own."""

    def __init__(self) -> None:
        super().__init__()
        self.id = 3
        self.linears = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)])

    def magic(self) -> int:
        return 42

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linears[1](self.linears[0](x)).sum()


def _model_attributes(rank: int, world_size: int) -> list:
    """[Note: the model's attributes through the engine]: what the engine lacks is the model's, at stages 0 and 3."""
    import zeroshard

    seen = []
    for stage in (0, 3):
        model = _WithExtras()
        config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        try:
            _ = engine.no_such_attribute
        except AttributeError as error:
            missing = str(error)
        seen.append(
            (
                engine.id,
                engine.magic(),
                engine.linears is model.linears,
                engine.config is vars(engine)["config"],
                missing,
            )
            + (hasattr(engine, "__deepcopy__"), engine.training)
        )
        engine.destroy()
    return seen


def _all(rank: int, world_size: int):
    return (
        _client_objects(rank, world_size),
        _callable_optimizer_and_dataloader(rank, world_size),
        _no_sync_and_destroy(rank, world_size),
        _stage2_rejects_no_sync(rank, world_size),
        _model_attributes(rank, world_size),
    )


def test_engine_api():
    results = run_on_ranks(_all, 2)
    (lrs, api), _, _, _, attributes = results[0]
    missing = "'Engine' object has no attribute 'no_such_attribute'"
    assert attributes == [(3, 42, True, True, missing, False, True)] * 2, attributes
    assert [round(x[0], 10) for x in lrs] == [5e-4, 2.5e-4, 1.25e-4, 6.25e-5]
    assert api[:5] == (4, 2, 1, True, 2)
    assert "call engine.step()" in api[5][0] and "applicable to cases where weights are partitioned" in api[5][1]
    assert api[5][2] == (True, True, True) and api[5][3], api[5]  # the clones' own storages; the views' shared one
    assert "engine was destroyed" in api[5][4], api[5]
    (n0, seen0), (n1, seen1) = results[0][1], results[1][1]
    assert n0 == n1 == 10 and not set(seen0) & set(seen1) and sorted(seen0 + seen1) == list(range(40))
    for r in results:
        assert r[2] < 1e-6, f"no_sync result differs from accumulation by {r[2]}"
        assert r[3] and "no_sync" in r[3] and "stage 2" in r[3]


# -- two backward calls before one step (a GAN's discriminator) -----------------------------------------------
GAN_ITERS = 3


def _gan_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(GAN_ITERS)]


def _gan_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1), torch.nn.Linear(2, 4)


def _gan(rank: int, world_size: int, zero: dict, through_d: bool = False) -> list[torch.Tensor]:
    """DeepSpeedExamples' GAN pattern: the discriminator engine runs two backward passes (real, fake) before its
    step, the raw modules' zero_grad() is called between steps, and each engine owns one module."""
    import zeroshard

    D, G = _gan_models()
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": zero}
    eD, *_ = zeroshard.initialize(model=D, model_parameters=D.parameters(), config=config)
    eG, *_ = zeroshard.initialize(model=G, model_parameters=G.parameters(), config=config)
    for x, z in _gan_data(rank):
        D.zero_grad()
        eD.backward(D(x).sum())
        eD.backward(D(G(z).detach()).pow(2).sum())
        eD.step()
        G.zero_grad()
        eG.backward(-(D(G(z)).sum() if through_d else G(z).sum()))  # through_d: gradients land on D too
        eG.step()
    with eD.gathered_for_generation(), eG.gathered_for_generation():
        return [p.detach().clone() for p in [*D.parameters(), *G.parameters()]]


def _gan_reference(world_size: int, through_d: bool = False) -> list[torch.Tensor]:
    """One process: the same losses, averaged over the ranks' batches, each model's gradients clipped to 1."""
    D, G = _gan_models()
    opt_d, opt_g = torch.optim.Adam(D.parameters(), lr=0.1), torch.optim.Adam(G.parameters(), lr=0.1)
    data = [_gan_data(r) for r in range(world_size)]
    for it in range(GAN_ITERS):
        opt_d.zero_grad()
        for x, z in (d[it] for d in data):
            ((D(x).sum() + D(G(z).detach()).pow(2).sum()) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(D.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt_d.step()
        opt_g.zero_grad()
        for _, z in (d[it] for d in data):
            (-(D(G(z)).sum() if through_d else G(z).sum()) / world_size).backward()
        torch.nn.utils.clip_grad_norm_(G.parameters(), 1.0)
        opt_g.step()
    return [p.detach().clone() for p in [*D.parameters(), *G.parameters()]]


# slow: stage 1, a secondary variant of stage 2 (the same reducer; stage 0 is the DeepSpeed behaviour matched)
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_another_engines_gradients_stay_in_grad_until_zero_grad(stage):
    """[Note: gradients outside engine.backward]: G's loss flows through D (DeepSpeedExamples' GAN); D's gradients
    from it stay in .grad and D.zero_grad() clears them, as in DeepSpeed's stage 0 (stages 0-2; stage 3 reduces
    them into its shards, as DeepSpeed's stage 3 does)."""
    reference = _gan_reference(2, through_d=True)
    zero = {"stage": stage}
    for params in run_on_ranks(_gan, 2, zero, True):
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, z=zero: f"{z}: {m}")


@pytest.mark.parametrize(
    "zero",
    [
        {"stage": 0},
        {"stage": 1},
        {"stage": 1, "reduce_scatter": False},  # the all-reduce path instead of reduce-scatter
        {"stage": 2},
        {"stage": 3},
    ],
    ids=["stage0", "stage1", "stage1-no-reduce-scatter", "stage2", "stage3"],
)
def test_two_backwards_before_one_step_add_up_on_every_stage(zero):
    """[Note: a second backward]: the second backward's gradients add to the first's (before the fix, stage 0
    counted the first backward once per rank)."""
    reference = _gan_reference(2)
    for params in run_on_ranks(_gan, 2, zero):
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, z=zero: f"{z}: {m}")


# -- a stalled rank ---------------------------------------------------------------------------------------------
def _stalled(rank: int, world_size: int):
    import time

    import zeroshard

    case = Case(stage=2, steps=2)
    model = build_model(case)
    config = ds_config(case)
    config["zeroshard"] = {"collective_timeout_s": 4}
    # the script starts the group itself, as DeepSpeed scripts do: the config's deadline is its (it was torch's
    # 30 minutes, and the message said the config's 4 s)
    zeroshard.init_distributed(dist_backend="gloo", config=config)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    batches = global_batches(case, world_size)
    engine.backward(engine(*micro_batch(batches[0], 0, rank, world_size, case.micro)))
    engine.step()
    if rank == 1:
        time.sleep(9)  # stalls (as under SIGSTOP): never answers while rank 0 waits
    start = time.time()
    try:
        engine.backward(engine(*micro_batch(batches[1], 0, rank, world_size, case.micro)))
        engine.step()
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        return type(err).__name__, str(err), time.time() - start
    return None, None, time.time() - start


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by deadlines: test_node_watch.py,
# test_gathering_agreement.py
@pytest.mark.slow
def test_a_stalled_rank_fails_the_job_by_the_deadline_naming_it():
    name, message, seconds = run_on_ranks(_stalled, 2, timeout=120)[0]
    assert name == "CollectiveTimeoutError" and seconds < 30, (name, message, seconds)
    assert "engine.backward" in message and "rank 1: did not answer" in message and "rank 0: in" in message, message
    assert "waited longer than 4s (the process group's timeout" in message, message


# -- engine.optimizer.zero_grad inside an accumulation window -----------------------------------------------------
def _zero_grad_each_micro_step(rank: int, world_size: int):
    """Per stage: the weights after two windows of two micro-steps, with and without `optimizer.zero_grad()` before
    each micro-step (a habit of scripts written for torch)."""
    import zeroshard

    out = {}
    for stage in (1, 2, 3):
        case = Case(stage=stage, gas=2, steps=2)
        for zeroing in (False, True):
            model = build_model(case)
            engine, optimizer, _, _ = zeroshard.initialize(
                model=model, model_parameters=param_groups(model, case), config=ds_config(case)
            )
            for batch in global_batches(case, world_size):
                for micro in range(case.gas):
                    if zeroing:
                        optimizer.zero_grad()
                    engine.backward(engine(*micro_batch(batch, micro, rank, world_size, case.micro)))
                    engine.step()
            out[(stage, zeroing)] = [v.clone() for v in engine.module.state_dict().values()]
            engine.destroy()
    return out


def test_optimizer_zero_grad_inside_a_window_keeps_or_drops_it_as_deepspeed():
    """DeepSpeed 0.19.8 measured: its stage-2 optimizer's `zero_grad` inside a window leaves the reduced gradients
    (the window still accumulates), stages 1 and 3 drop them ([Note: the engine's optimizer])."""
    for out in run_on_ranks(_zero_grad_each_micro_step, 2):
        same = {
            s: all(torch.equal(a, b) for a, b in zip(out[(s, False)], out[(s, True)], strict=True)) for s in (1, 2, 3)
        }
        assert same == {1: False, 2: True, 3: False}, same
