"""ZeRO stage 2 with a parameter that never receives a gradient: `ignore_unused_parameters` decides.

Re-created (as plain functions run on 2 ranks, rewritten) from DeepSpeed
`tests/unit/runtime/zero/test_ignore_unused_parameters.py`, commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641.
Kept as upstream: the config (micro batch 2, gradient accumulation 2, stage 2, `cpu_offload`,
`ignore_unused_parameters`, "Adam", bf16 where the accelerator has it), `initialize(config=, model=,
model_parameters=)`, the backward/step loop; with `ignore_unused_parameters: false` the loop must raise an
AssertionError that names the option, with `true` it trains. Changed: `torch_adam: true` so that DeepSpeed does not
JIT-build its CPU Adam, the unused layer is wider (see the model), and the losses of the accepted run are reported.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import importlib
import json
import os

import torch
import torch.distributed as dist

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
get_accelerator = importlib.import_module(f"{deepspeed.__name__}.accelerator").get_accelerator


class UnusedParametersModel(torch.nn.Module):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        # upstream: Linear(hidden_dim, hidden_dim), on one rank. On 2 ranks ZeRO-2 splits the flat parameters in
        # halves, and only the rank owning the unused one raises while its peer waits in a collective: a wide
        # unused layer lies in both halves, so that both ranks raise.
        self.unused_linear = torch.nn.Linear(hidden_dim, 16 * hidden_dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_loss(self.linears[0](x), y)


def random_dataloader(model, total_samples: int, hidden_dim: int, device, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    data = torch.randn(total_samples, hidden_dim, generator=generator).to(device=device, dtype=dtype)
    label = torch.randint(0, hidden_dim, (total_samples,), generator=generator).to(device)
    dataset = torch.utils.data.TensorDataset(data, label)
    return torch.utils.data.DataLoader(dataset, batch_size=model.train_micro_batch_size_per_gpu())


def check(ignore_unused_parameters: bool) -> list[float]:
    config_dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "zero_optimization": {
            "stage": 2,
            "cpu_offload": True,
            "ignore_unused_parameters": ignore_unused_parameters,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    dtype = torch.float32
    if get_accelerator().is_bf16_supported():
        config_dict["bf16"] = {"enabled": True}
        dtype = torch.bfloat16
    elif get_accelerator().is_fp16_supported():
        config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
        dtype = torch.float16
    hidden_dim = 4
    torch.manual_seed(0)
    model = UnusedParametersModel(hidden_dim=hidden_dim)
    model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters())
    data_loader = random_dataloader(
        model=model, total_samples=10, hidden_dim=hidden_dim, device=model.device, dtype=dtype
    )

    losses = []

    def _loop() -> None:
        for batch in data_loader:
            loss = model(batch[0], batch[1])
            model.backward(loss)
            model.step()
            losses.append(loss.item())

    if ignore_unused_parameters:
        _loop()
        return losses
    try:
        _loop()
    except AssertionError as e:
        assert e.args and "ignore_unused_parameters" in e.args[0], e.args
        return []
    raise AssertionError("an unused parameter was accepted with ignore_unused_parameters=False")


def main() -> None:
    results = {f"ignore_unused_parameters_{flag}": check(flag) for flag in (True, False)}
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": results}), flush=True)


if __name__ == "__main__":
    main()
