"""`deepspeed.linear` on 2 gloo ranks: DeepSpeed's own `tests/unit/linear/test_ctx.py::TestEngine` re-created (a model
built under `linear.Init` with LoRA and the base weights sharded over both ranks, `init_lora`, a bf16 ZeRO-1 engine:
the rank-local shards are not broadcast, then training), under zeroshard and under DeepSpeed 0.19.8 in the same
processes, and an fp32 run of the same model against a single-process reference (the whole base weights, the
adapters every rank starts from, torch's Adam on the global batch) every step."""

from __future__ import annotations

from typing import Any

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks

HIDDEN, LAYERS, STEPS, MICRO = 64, 4, 5, 2


def _model_class() -> Any:
    import torch
    from torch import nn

    class Simple(nn.Module):
        """DeepSpeed's SimpleModel without its biases (`OptimizedLinear`'s default drops them, as in its test)."""

        def __init__(self, dtype: Any) -> None:
            super().__init__()
            kwargs = {} if dtype is None else {"dtype": dtype}
            self.linears = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN, **kwargs) for _ in range(LAYERS)])
            self.loss = nn.CrossEntropyLoss()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for layer in self.linears:
                x = layer(x)
            return self.loss(x, y)

    return Simple


def _batch(rank: int, step: int, dtype: Any) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(MICRO, HIDDEN, generator=gen).to(dtype), torch.randint(0, HIDDEN, (MICRO,), generator=gen)


def _config(bf16: bool) -> dict[str, Any]:
    return {
        "train_batch_size": 2 * MICRO,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015 if bf16 else 0.01}},
        "zero_optimization": {"stage": 1},
    }


def _train(lib: Any, rank: int, bf16: bool) -> dict[str, Any]:
    import torch

    torch.manual_seed(
        1000 + rank
    )  # every rank's shards and adapters differ: the adapters are rank 0's after initialize
    lora = lib.linear.LoRAConfig(lora_r=16, lora_alpha=16, base_weight_sharding=2)
    with lib.linear.Init(lora_config=lora, quant_config=None):
        model = _model_class()(None if bf16 else torch.float32)
    lib.linear.init_lora(model)
    built = [layer.weight.detach().clone() for layer in model.linears]
    engine, *_ = lib.initialize(config=_config(bf16), model=model, model_parameters=model.parameters())
    layers = engine.module.linears
    start = [
        (layer.lora_weight_1.weight.detach().clone(), layer.lora_weight_2.weight.detach().clone()) for layer in layers
    ]
    with torch.no_grad():
        whole = [layer.full_weight().clone() for layer in layers]
    losses = []
    dtype = torch.bfloat16 if bf16 else torch.float32
    for step in range(STEPS):
        loss = engine(*_batch(rank, step, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kept = all(torch.equal(b, layer.weight) for b, layer in zip(built, layers, strict=True))
    return {"losses": losses, "kept": kept, "start": start, "whole": whole, "engine": engine}


def _reference(start: list[Any], whole: list[Any], world_size: int) -> list[float]:
    """One process, fp32: the whole base weights, the adapters rank 0 started from, clipping at 1.0, Adam on the
    global batch."""
    import torch

    adapters = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in start]
    opt = torch.optim.Adam([t for pair in adapters for t in pair], lr=0.01)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for rank in range(world_size):
            x, y = _batch(rank, step, torch.float32)
            for w, (a, b) in zip(whole, adapters, strict=True):
                x = torch.nn.functional.linear(x, w) + 1.0 * ((x @ a.t()) @ b.t())
            per_rank.append(torch.nn.functional.cross_entropy(x, y))
        loss = sum(per_rank) / world_size
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([t for pair in adapters for t in pair], 1.0)  # gradient_clipping's default
        opt.step()
        losses.append([p.item() for p in per_rank])
    return losses


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    import zeroshard

    deepspeed = import_deepspeed()
    import_deepspeed("deepspeed.linear")

    deepspeed.init_distributed(dist_backend="gloo")  # the layers are built before initialize, as in DeepSpeed's test
    out: dict[str, Any] = {}
    for bf16 in (True, False):
        ours = _train(zeroshard, rank, bf16)
        theirs = _train(deepspeed, rank, bf16)
        name = "bf16" if bf16 else "fp32"
        out[f"{name} losses"] = (ours["losses"], theirs["losses"])
        out[f"{name} shards kept"] = (ours["kept"], theirs["kept"])
        out[f"{name} whole weights equal"] = all(
            torch.equal(a, b) for a, b in zip(ours["whole"], theirs["whole"], strict=True)
        )
        if not bf16:
            out["reference"] = [per[rank] for per in _reference(ours["start"], ours["whole"], world_size)]
        ours["engine"].destroy()
    return out


def test_lora_optimized_linear_trains_as_deepspeed_and_the_reference() -> None:
    for rank, out in enumerate(run_on_ranks(_cases, 2, timeout=300)):
        for name in ("bf16", "fp32"):
            ours, theirs = out[f"{name} losses"]
            if name == "bf16":  # bit for bit
                assert ours == theirs, (rank, name, ours, theirs)
            else:  # DeepSpeed's fp32 Adam rounds its update differently from torch's (measured: 2e-7 after 5 steps)
                assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(ours, theirs, strict=True)), (rank, ours, theirs)
            assert out[f"{name} shards kept"] == (True, True)
            assert out[f"{name} whole weights equal"]
        ours, _ = out["fp32 losses"]
        for got, want in zip(ours, out["reference"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (rank, ours, out["reference"])


def _build(lib: Any, seed: int, **lora: Any) -> Any:
    import torch

    torch.manual_seed(seed)
    config = lib.linear.LoRAConfig(lora_r=8, lora_alpha=16, base_weight_sharding=2, target_mods=["linears"], **lora)
    with lib.linear.Init(lora_config=config):
        model = _model_class()(torch.float32)
    lib.linear.init_lora(model)
    return model


def _steps(engine: Any, rank: int, first: int, count: int) -> list[float]:
    import torch

    losses = []
    for step in range(first, first + count):
        loss = engine(*_batch(rank, step, torch.float32))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _engine_cases(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import json
    import os

    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.errors import ConfigError

    zeroshard.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {}
    config = _config(bf16=False)
    refused = {
        "stage 3": {"config": config | {"zero_optimization": {"stage": 3}}},
        "fsdp2": {"config": config | {"zero_optimization": {"stage": 2}}, "backend": "fsdp2"},
    }
    for name, kwargs in refused.items():
        model = _build(zeroshard, 5 + rank)
        try:
            zeroshard.initialize(model=model, model_parameters=model.parameters(), **kwargs)
        except ConfigError as err:
            out[f"{name} refused"] = str(err)

    quantized = torch.nn.Sequential(
        zeroshard.linear.QuantizedLinear(128, 4, quantization_config=zeroshard.linear.QuantizationConfig(group_size=64))
    )
    try:
        zeroshard.initialize(model=quantized, config=refused["stage 3"]["config"] | {"optimizer": None})
    except ConfigError as err:
        out["quantized at stage 3 refused"] = str(err)

    model = _build(zeroshard, 5 + rank)
    shards = [layer.weight.detach().clone() for layer in model.linears]
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    out["first"] = _steps(engine, rank, 0, 2)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="t")  # frozen parameters left out, with a warning
    with open(os.path.join(folder, "ckpt", "t", "metadata.json")) as fh:
        out["excluded"] = sorted(json.load(fh)["excluded"])
    out["straight on"] = _steps(engine, rank, 2, 2)
    engine.save_16bit_model(folder, "model.bin")
    with torch.no_grad():
        whole = [layer.full_weight().clone() for layer in engine.module.linears]
    engine.destroy()

    again = _build(zeroshard, 5 + rank)  # the same shards (the base weights of a resumed run come from its files)
    engine, *_ = zeroshard.initialize(model=again, model_parameters=again.parameters(), config=config)
    engine.load_checkpoint(os.path.join(folder, "ckpt"), tag="t")
    out["resumed"] = _steps(engine, rank, 2, 2)
    out["resumed shards"] = all(
        torch.equal(s, layer.weight) for s, layer in zip(shards, engine.module.linears, strict=True)
    )
    engine.destroy()

    offloaded = _build(zeroshard, 5 + rank, offload_ratio=0.5)  # the first half of the base weights to the host
    engine, *_ = zeroshard.initialize(model=offloaded, model_parameters=offloaded.parameters(), config=config)
    out["offload marks"] = [getattr(layer.weight, "ds_offload", None) for layer in engine.module.linears]
    out["offload losses"] = _steps(engine, rank, 0, 2)
    engine.destroy()

    from zeroshard.linear import LoRAConfig, LoRAOptimizedLinear

    kept = LoRAConfig(lora_r=2, base_weight_sharding=2, regather_in_backward=False)
    heads = [LoRAOptimizedLinear(16, 16, lora_config=kept, dtype=torch.float32) for _ in range(2)]
    x = torch.randn(3, 16, requires_grad=True)
    outputs = [head(x) for head in heads]  # both heads on both ranks; each rank back-propagates through its own
    outputs[rank].sum().backward()
    with torch.no_grad():  # (every rank gathers both, in one order)
        head_weight = [head.full_weight() for head in heads][rank]
    out["heads per rank"] = torch.equal(x.grad, torch.ones(3, 16) @ head_weight)  # the adapters start at zero

    dist.barrier()
    saved = torch.load(os.path.join(folder, "model.bin"), weights_only=True)
    out["16-bit file whole"] = all(torch.equal(saved[f"linears.{i}.weight"], w) for i, w in enumerate(whole))
    fresh = _build(zeroshard, 99)  # other shards: the file's whole weights narrow to this rank's
    fresh.load_state_dict(saved, strict=False)
    out["16-bit file reloads"] = all(
        torch.equal(s, layer.weight) for s, layer in zip(shards, fresh.linears, strict=True)
    )
    return out


def test_sharded_base_weights_in_the_engine_checkpoints_and_model_files(tmp_path: Any) -> None:
    for out in run_on_ranks(_engine_cases, 2, str(tmp_path), timeout=300):
        assert out["stage 3 refused"].startswith(
            "linears.0: a LoRAOptimizedLinear with base_weight_sharding=2 keeps its rank's shard of the base weight, "
            "which ZeRO stage 3 would shard again (4 such layers)"
        )
        assert "which the fsdp2 backend would shard again" in out["fsdp2 refused"]
        assert out["quantized at stage 3 refused"].startswith(
            "0.weight: a deepspeed.linear QuantizedParameter (1 in the model) holds fp8 bytes, which ZeRO stage 3 "
            "cannot shard"
        )
        assert out["excluded"] == [f"linears.{i}.weight" for i in range(4)]  # the shards, never written
        assert out["resumed"] == out["straight on"]
        assert out["offload marks"] == [True, True, False, False], out["offload marks"]
        assert out["offload losses"] == out["first"], (out["offload losses"], out["first"])
        assert out["heads per rank"]
        assert out["resumed shards"] and out["16-bit file whole"] and out["16-bit file reloads"]


def _pretrained_cases(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers

    import zeroshard
    from zeroshard.linear import Init, LoRAConfig, LoRAOptimizedLinear, QuantizationConfig, QuantizedParameter

    zeroshard.init_distributed(dist_backend="gloo")
    auto = transformers.AutoModelForCausalLM
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    if rank == 0:
        torch.manual_seed(0)
        auto.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    dist.barrier()
    baseline = auto.from_pretrained(folder)
    with Init(lora_config=LoRAConfig(lora_r=4, lora_alpha=8, base_weight_sharding=2)):
        model = auto.from_pretrained(folder)
    out: dict[str, Any] = {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRAOptimizedLinear)}
    plain = dict(baseline.named_modules())
    out["targets sharded"] = all(
        torch.equal(m.weight, plain[n].weight.flatten().chunk(2)[rank])
        and m.weight.numel() == plain[n].weight.numel() // 2
        for n, m in layers.items()
        if not m.disabled
    )
    with torch.no_grad():
        out["targets gather whole"] = all(
            torch.equal(m.full_weight(), plain[n].weight) for n, m in layers.items() if not m.disabled
        )
    out["lm_head plain"] = layers["lm_head"].disabled and torch.equal(layers["lm_head"].weight, baseline.lm_head.weight)
    out["count"] = sum(not m.disabled for m in layers.values())
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    out["logits"] = torch.equal(model(ids).logits, baseline(ids).logits)

    quant = QuantizationConfig(group_size=64)
    with Init(lora_config=LoRAConfig(lora_r=4, base_weight_sharding=2), quant_config=quant):
        model = auto.from_pretrained(folder)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRAOptimizedLinear) and not m.disabled}
    with torch.no_grad():  # each rank's rows quantized, then gathered: fp8's relative error, 2^-4
        out["quantized shards"] = all(
            isinstance(m.weight, QuantizedParameter)
            and bool(((m.full_weight().float() - plain[n].weight.float()).abs() <= plain[n].weight.float().abs() / 16
                      + 2e-3).all())
            for n, m in layers.items()
        )  # fmt: skip
    return out


def test_from_pretrained_under_init_reads_each_ranks_shard(tmp_path: Any) -> None:
    for out in run_on_ranks(_pretrained_cases, 2, str(tmp_path), timeout=300):
        assert out == {
            "targets sharded": True, "targets gather whole": True, "lm_head plain": True, "count": 14, "logits": True,
            "quantized shards": True,
        }  # fmt: skip
