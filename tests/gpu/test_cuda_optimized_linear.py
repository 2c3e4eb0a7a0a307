"""`deepspeed.linear` on CUDA: fp8 base weights quantized and dequantized on the GPU, `offload: true` keeping the
base weight on the host between uses, and (with 2 GPUs) base weights sharded over NCCL ranks through a bf16 ZeRO-1
engine. Each result against the same sums on the same device (bit-equal), as tests/unit/test_optimized_linear_layers.py
does on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    import torch.nn.functional as F

    import zeroshard
    from zeroshard.linear import Init, LoRAConfig, LoRAOptimizedLinear, QuantizationConfig, QuantizedLinear, init_lora

    torch.cuda.set_device(rank)
    zeroshard.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", rank)
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    quant = QuantizationConfig(group_size=64)
    layer = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4), quantization_config=quant).to(device)
    torch.nn.init.normal_(layer.lora_weight_2.weight)
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = layer(x)
    w = layer.weight.dequantized()
    x2 = x.detach().clone().requires_grad_()
    want = F.linear(x2, w) + layer.lora_scaling_factor * layer.lora_weight_2(layer.lora_weight_1(x2))
    y.backward(torch.ones_like(y))
    want.backward(torch.ones_like(want))
    out["quantized on cuda"] = layer.weight.is_cuda and torch.equal(y, want) and torch.equal(x.grad, x2.grad)
    plain = QuantizedLinear(128, 16, quantization_config=QuantizationConfig(group_size=128))
    on_host = plain.weight.dequantized()
    plain.cuda()
    out["quantized moves"] = torch.equal(plain.weight.dequantized().cpu(), on_host)

    offloaded = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4, offload=True), device=device)
    resident = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4), device=device)
    resident.load_state_dict(offloaded.state_dict())
    resident.weight.data = resident.weight.data.to(device)
    z = torch.randn(5, 64, dtype=torch.bfloat16, device=device)
    out["offload keeps the host copy"] = offloaded.weight.device.type == "cpu" and torch.equal(
        offloaded(z), resident(z)
    )

    if world_size == 2:
        torch.manual_seed(10 + rank)
        with Init(lora_config=LoRAConfig(lora_r=8, base_weight_sharding=2)):
            model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        init_lora(model)
        shards = [m.weight.detach().clone() for m in model]
        config = {"train_batch_size": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}  # fmt: skip
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step * 2 + rank)
            loss = engine(torch.randn(2, 64, generator=gen).to(device, torch.bfloat16)).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        kept = all(torch.equal(s.to(device), m.weight) for s, m in zip(shards, engine.module, strict=True))
        out["sharded over nccl"] = kept and all(map(lambda v: v == v and abs(v) < 1e4, losses))
        engine.destroy()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_optimized_linear_on_cuda(world_size: int) -> None:
    for out in run_on_ranks(_cases, world_size):
        assert all(out.values()), out
        assert ("sharded over nccl" in out) == (world_size == 2)
