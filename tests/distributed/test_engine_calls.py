"""DeepSpeed's engine calls that act (engine_calls.py): a global batch changed mid-run trains as a single-process
reference and DeepSpeed 0.19.8 with the same calls; `empty_partition_cache` releases what a forward left gathered
without changing the numerics; `load_module_state_dict` takes rank 0's values everywhere; `module_state_dict` and
`deepspeed_io` as DeepSpeed's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.parity import TINY, Case, build_model, ds_config, flat_params, param_groups, relative_difference
from helpers.windows import MICRO, batches, mine, reference_windows

WINDOWS = [2, 2, 4, 1, 1]  # gradient_accumulation_steps 2, then set_train_batch_size to 4 and to 1 micro-batches
CASES = [Case(stage=1, gas=2, steps=5), Case(stage=2, gas=2, steps=5), Case(stage=3, gas=2, steps=5)]


def _resized(rank: int, world_size: int, engine: Any, gathered: Any) -> tuple[Any, ...]:
    """The windows above, the engine's own accumulation deciding the boundaries; the batch changes between them."""
    losses, infos = [], []
    for window in batches(world_size, WINDOWS):
        if len(window) != engine.gradient_accumulation_steps():
            engine.set_train_batch_size(len(window) * MICRO * world_size)
        infos.append((engine.train_batch_size(), engine.gradient_accumulation_steps()))
        step_losses = []
        for batch in window:
            loss = engine(*mine(batch, rank))
            engine.backward(loss)
            step_losses.append(loss.item())
            engine.step()
        losses.append(sum(step_losses) / len(step_losses))
    with gathered(list(engine.module.parameters())):
        params = flat_params(engine.module)
    return losses, params, infos, (engine.global_steps, engine.global_samples, engine.micro_steps)


def _batch_sizes(rank: int, world_size: int) -> list[Any]:
    import zeroshard

    out: list[Any] = []
    for case in CASES:
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        out.append(_resized(rank, world_size, engine, zeroshard.GatheredParameters))
        engine.set_train_micro_batch_size(4)
        out.append((engine.get_batch_info(), engine.train_batch_size()))
        with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu x data-parallel replicas"):
            engine.set_train_batch_size(12)  # 4 x 2 replicas does not divide it
        engine.destroy()
    bf16 = Case(stage=3, gas=1, dtype="bf16")
    model = build_model(bf16)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, bf16), config=ds_config(bf16))
    with pytest.raises(zeroshard.ZeroshardError, match="gradient_accumulation_steps 1 -> 2 at stage 3"):
        engine.set_train_batch_size(2 * MICRO * world_size)
    engine.destroy()
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    for case in CASES:
        model = build_model(case)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        out.append(_resized(rank, world_size, engine, deepspeed.zero.GatheredParameters))
        engine.destroy()
    return out


def _reference(world_size: int, case: Case) -> tuple[list[float], torch.Tensor]:
    """Each window's losses divided by the window's length: the accumulation steps of the moment."""
    return reference_windows(world_size, case, WINDOWS, lambda length: length)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by engine calls:
# test_empty_partition_cache_load_module_state_dict_and_deepspeed_io
@pytest.mark.slow
def test_a_global_batch_changed_mid_run_trains_as_the_reference_and_deepspeed() -> None:
    results = run_on_ranks(_batch_sizes, 2, timeout=900)
    expected_infos = [(w * MICRO * 2, w) for w in WINDOWS]
    for i, case in enumerate(CASES):
        ref_losses, ref_params = _reference(2, case)
        for per_rank in results:
            (losses, params, infos, counters), after_micro = per_rank[2 * i], per_rank[2 * i + 1]
            deepspeed = per_rank[2 * len(CASES) + i]
            assert infos == deepspeed[2] == expected_infos, case.name
            # DeepSpeed counts a step's samples by the batch size of the moment, as zeroshard does
            assert counters == deepspeed[3] == (5, sum(WINDOWS) * MICRO * 2, sum(WINDOWS)), case.name
            assert relative_difference(params, ref_params) < 1e-6, case.name
            assert relative_difference(params, deepspeed[1]) < 1e-6, case.name
            assert torch.allclose(torch.tensor(losses), torch.tensor(deepspeed[0]), rtol=1e-6), case.name
            assert after_micro == ((4 * 1 * 2, 4, 1), 8), case.name  # gas 1 after the last window
        mean = [sum(r[2 * i][0][w] for r in results) / 2 for w in range(len(WINDOWS))]
        assert torch.allclose(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-6), case.name


def _gathered_bytes(engine: Any) -> int:
    return engine.memory_report().gathered_params


def _cache_and_state(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    case = Case(stage=3, persistence=100, steps=4)  # the biases and norms: the persistent unit
    out: dict[str, Any] = {}
    for release in (False, True):
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        persistent = _gathered_bytes(engine)
        losses = []
        for batch in batches(world_size, [1] * case.steps):
            x, y = mine(batch[0], rank)
            losses.append(engine(x, y).item())
            engine.backward(engine(x, y))
            engine.step()
            with torch.no_grad():  # an evaluation forward: no backward releases what it kept
                engine(x, y)
            if release:
                held = _gathered_bytes(engine)
                engine.empty_partition_cache()
                shapes = (engine.module.blocks[0].ln_1.weight.numel(), engine.module.blocks[0].mlp[0].weight.numel())
                out.setdefault("released", []).append((held, _gathered_bytes(engine), persistent, shapes))
        out[f"losses_{release}"] = losses
        engine.destroy()
    # load_module_state_dict: rank 0's dict everywhere (each rank passes its own; DeepSpeed broadcasts rank 0's)
    model = build_model(replace(case, variant="frozen"))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    source = build_model(replace(case, variant="frozen"))
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    engine.load_module_state_dict({"module": source.state_dict()})
    out["loaded"] = engine.module_state_dict()
    out["source"] = source.state_dict()
    out["trainable_keys"] = sorted(engine.module_state_dict(exclude_frozen_parameters=True))
    out["frozen"] = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
    with pytest.raises(zeroshard.ZeroshardError, match=r"missing keys \[\], unexpected keys \['extra'\]"):
        engine.load_module_state_dict({"module": {**source.state_dict(), "extra": torch.zeros(1)}})
    out["after_refused"] = engine.module_state_dict()
    partial = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}  # tied: wte stays
    with pytest.raises(
        zeroshard.ZeroshardError, match=r"missing keys \['blocks.0.attn.proj.weight', 'blocks.1.attn.proj"
    ):
        engine.load_module_state_dict({"module": {k: v for k, v in partial.items() if "attn.proj" not in k}})
    out["after_partial"] = engine.module_state_dict()  # torch copied the matching tensors; all undone
    # deepspeed_io: the training route shuffles this replica's share, the others read it in order
    data = torch.utils.data.TensorDataset(torch.arange(16))
    out["train"] = [b[0].tolist() for b in engine.deepspeed_io(data)]
    out["eval"] = [b[0].tolist() for b in engine.deepspeed_io(data, batch_size=4, route="eval")]
    engine.destroy()
    return out


def test_empty_partition_cache_load_module_state_dict_and_deepspeed_io() -> None:
    results = run_on_ranks(_cache_and_state, 2)
    for out in results:
        assert out["losses_True"] == out["losses_False"]  # releasing changes nothing but memory
        for held, after, persistent, (norm, matrix) in out["released"]:
            # the report counts the units gathered beside the persistent one, which stays gathered by design
            assert held > after == persistent == 0, out["released"]
            assert norm == TINY.n_embd and matrix == 0, out["released"]
        source0 = results[0]["source"]
        for key, value in out["loaded"].items():
            assert torch.equal(value, source0[key]), key
        assert out["frozen"] and not set(out["frozen"]) & set(out["trainable_keys"])
        assert set(out["trainable_keys"]) | set(out["frozen"]) == set(out["loaded"])
        for refused in ("after_refused", "after_partial"):  # refused loads leave the module as it was
            assert all(torch.equal(out[refused][k], v) for k, v in out["loaded"].items()), refused
    assert not torch.equal(results[1]["source"]["lm_head.weight"], results[0]["source"]["lm_head.weight"])
    train0, train1 = (sum(r["train"], []) for r in results)
    assert sorted(train0 + train1) == list(range(16)) and train0 != sorted(train0)  # disjoint, shuffled
    assert [len(b) for b in results[0]["train"]] == [2] * 4  # the micro-batch
    assert results[0]["eval"] == [[0, 2, 4, 6], [8, 10, 12, 14]] and results[1]["eval"][0] == [1, 3, 5, 7]


LOADS = [
    Case(stage=1),
    Case(stage=2, dtype="bf16"),
    Case(stage=3, persistence=100),
    Case(stage=3, offload="cpu", offload_param="cpu"),
]


def _loads(rank: int, world_size: int) -> list[Any]:
    """Each rank loads its own dict: rank 0's values become every rank's, in the parameters and the fp32 masters."""
    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param

    out = []
    for case in LOADS:
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        source = build_model(case)
        torch.manual_seed(200 + rank)
        with torch.no_grad():
            for p in source.parameters():
                p.normal_()
        engine.load_module_state_dict({"module": source.state_dict()})
        with zeroshard.GatheredParameters(list(engine.module.parameters())):
            engine.empty_partition_cache()  # the block's units stay gathered
            module = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
        masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        out.append((case.name, module, masters, source.state_dict() if rank == 0 else None))
        engine.destroy()
    # the fsdp2 backend: a block holds its units; emptying the cache inside it leaves them gathered
    case = Case(stage=3)
    model, config = build_model(case), {**ds_config(case), "zeroshard": {"backend": "fsdp2"}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    with zeroshard.GatheredParameters([engine.module.lm_head.weight], modifier_rank=0):
        engine.empty_partition_cache()
        if rank == 0:
            with torch.no_grad():
                engine.module.lm_head.weight.fill_(0.25)
    out.append(bool((safe_get_full_fp32_param(engine.module.lm_head.weight) == 0.25).all()))
    with pytest.raises(zeroshard.ZeroshardError, match="not supported on the fsdp2 backend"):
        engine.load_module_state_dict({"module": model.state_dict()})
    engine.destroy()
    return out


def test_a_module_load_takes_rank_0s_values_into_parameters_and_masters() -> None:
    results = run_on_ranks(_loads, 2)
    for per_rank in results:
        assert per_rank.pop() is True  # fsdp2: the held unit survived empty_partition_cache, and took the change
        for (name, module, masters, _), (_, _, _, source) in zip(per_rank, results[0], strict=True):
            for key, value in module.items():
                tol = 1e-2 if "bf16" in name else 0
                assert torch.allclose(value, source[key].float(), rtol=tol, atol=tol), (name, key)
                assert torch.equal(masters[key].float(), value) or "bf16" in name, (name, key)


def _torch_keys(rank: int, world_size: int) -> list[bool]:
    """torch's load-time hooks decide the keys: BatchNorm fills a missing `num_batches_tracked` (an old dict)."""
    import zeroshard

    out = []
    for stage in (1, 3):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        source = {k: v + 1 for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
        config = {"train_batch_size": 2, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage}}
        engine, *_ = zeroshard.initialize(model=model, config=config)
        engine.load_module_state_dict({"module": source})  # strict: torch's own strict load accepts it too
        out.append(torch.equal(engine.module_state_dict()["0.weight"], source["0.weight"]))
        engine.destroy()
    return out


def test_load_module_state_dict_keys_are_torchs() -> None:
    assert run_on_ranks(_torch_keys, 1) == [[True, True]]
