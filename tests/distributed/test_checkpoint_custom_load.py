"""`load_checkpoint(custom_load_fn=f)` ([Note: custom_load_fn] in checkpoint/custom_load.py), DeepSpeed's argument:
before, a TypeError. On 2 ranks: a function that renames keys (a model saved inside a wrapper, as `torch.compile`'s
`_orig_mod.`) loads the weights; one that keeps some prefixes leaves the rest at their initial values; a resume with
the optimizer state restores the masters over what the function wrote at stages 1-3 (the next step is a plain load's
to the bit) and keeps the function's values at fp32 stage 0 (DeepSpeed's torch optimizer), without it the function's
values are the weights; a function that raises on one rank raises on every rank and leaves
the engine torn until a load succeeds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch


class Wrapped(nn.Module):
    """The model under another prefix (`inner.`), as a compiled model's `_orig_mod.`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(x, y)


def _step(engine, batch, rank: int) -> None:
    x, y = micro_batch(batch, 0, rank, 2, 2)
    engine.backward(engine(x, y))
    engine.step()


def _weights(engine, inner: bool = False) -> torch.Tensor:
    with engine.gathered_for_generation():
        return flat_params(engine.module.inner if inner else engine.module)


def _shifted(src, dst) -> None:
    dst.load_state_dict({k: v + 1 for k, v in src.items()})


def _stripped(src, dst) -> None:
    dst.load_state_dict({k.removeprefix("inner."): v for k, v in src.items()})


def _first_block_only(src, dst) -> None:
    dst.load_state_dict({k: v for k, v in src.items() if k.startswith("blocks.0.")}, strict=False)


def _run(rank: int, world: int, stage: int, folder: str):
    import zeroshard

    case = Case(stage=stage, steps=2)
    first, second = global_batches(case, world)

    def engine(model=None):
        built, *_ = zeroshard.initialize(model=model or build_model(case), config=ds_config(case))
        return built

    out = {}
    saver = engine()
    _step(saver, first, rank)
    saver.save_checkpoint(folder, tag="plain")
    saved = _weights(saver)
    wrapped = engine(Wrapped(build_model(case)))
    _step(wrapped, first, rank)
    wrapped.save_checkpoint(folder, tag="wrapped")

    plain = engine()
    plain.load_checkpoint(folder, tag="plain")
    _step(plain, second, rank)
    shifted = engine()
    shifted.load_checkpoint(folder, tag="plain", custom_load_fn=_shifted)
    out["counters"] = (shifted.global_steps, shifted.micro_steps)
    # fp32 stage 0: the masters are the parameters, the function's values stay (DeepSpeed's torch optimizer loads its
    # state only); stages 1-3: the restored masters are the weights, the next step a plain load's
    out["after_load"] = torch.equal(_weights(shifted), saved + 1 if stage == 0 else saved)
    _step(shifted, second, rank)
    out["resume_is_a_plain_load"] = torch.equal(_weights(shifted), _weights(plain))

    weights_only = engine()
    weights_only.load_checkpoint(folder, tag="plain", load_optimizer_states=False, custom_load_fn=_shifted)
    out["function_values"] = torch.equal(_weights(weights_only), saved + 1)

    renamed = engine()
    renamed.load_checkpoint(folder, tag="wrapped", load_module_only=True, custom_load_fn=_stripped)
    out["renamed"] = torch.equal(_weights(renamed), _weights(wrapped, inner=True))

    kept = engine()
    initial = {n: p.detach().clone() for n, p in build_model(case).named_parameters()}
    trained = {n: p.detach().clone() for n, p in build_model(case).named_parameters()}
    with torch.no_grad():  # the saved values by name
        offset = 0
        for p in trained.values():
            p.copy_(saved[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    kept.load_checkpoint(folder, tag="plain", load_module_only=True, custom_load_fn=_first_block_only)
    want = torch.cat([(trained if n.startswith("blocks.0.") else initial)[n].reshape(-1) for n in initial])
    out["filtered"] = torch.equal(_weights(kept), want)

    def failing(src, dst) -> None:
        _shifted(src, dst)
        if torch.distributed.get_rank() == 1:
            raise ValueError("no such layer")

    before = _weights(plain)
    try:
        plain.load_checkpoint(folder, tag="plain", custom_load_fn=failing)
        out["raised"] = None
    except Exception as err:  # noqa: BLE001 - what each rank saw
        out["raised"] = str(err)
    try:  # torn: the function may have written part of the module
        _step(plain, second, rank)
        out["trained_on"] = True
    except Exception as err:  # noqa: BLE001 - what each rank saw
        out["trained_on"] = str(err)
    plain.load_checkpoint(folder, tag="plain")  # a load that succeeds clears it
    _step(plain, second, rank)
    out["resumed"] = torch.equal(_weights(plain), before)
    for built in (saver, wrapped, plain, shifted, weights_only, renamed, kept):
        built.destroy()
    return out


@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=pytest.mark.slow) for s in (0, 1, 2)] + [3]
)  # slow: CI budget (stages 0-2 share the flat code; stage 3 gathers for the function)
def test_custom_load_fn(tmp_path, stage: int) -> None:
    for rank, out in enumerate(run_on_ranks(_run, 2, stage, str(tmp_path))):
        assert out["counters"] == (1, 1), (rank, out)
        assert out["after_load"], (rank, out)
        assert out["resume_is_a_plain_load"] == (stage > 0), (rank, out)
        assert out["function_values"], (rank, out)
        assert out["renamed"], (rank, out)
        assert out["filtered"], (rank, out)
        why = "no such layer" if rank == 1 else "failed on rank(s) [1]"  # rank 0 names the rank that failed
        assert out["raised"] is not None and why in out["raised"], (rank, out)
        assert "custom_load_fn failed" in out["trained_on"] and "clears this" in out["trained_on"], (rank, out)
        assert out["resumed"], (rank, out)


def _refused_on_fsdp2(rank: int, world: int, folder: str):
    import zeroshard

    case = Case(stage=2, steps=2)
    first, second = global_batches(case, world)
    config = {**ds_config(case), "zeroshard": {"backend": "fsdp2"}}
    engine, *_ = zeroshard.initialize(model=build_model(case), config=config)
    _step(engine, first, rank)
    engine.save_checkpoint(folder, tag="a")
    try:
        engine.load_checkpoint(folder, tag="a", custom_load_fn=_shifted)
        said = None
    except Exception as err:  # noqa: BLE001 - what each rank saw
        said = str(err)
    _step(engine, second, rank)  # nothing was loaded: not torn
    engine.destroy()
    return said


def test_custom_load_fn_is_refused_where_the_module_holds_dtensors(tmp_path) -> None:
    for said in run_on_ranks(_refused_on_fsdp2, 2, str(tmp_path)):
        assert said is not None and "fsdp2" in said and "nothing was loaded" in said, said
