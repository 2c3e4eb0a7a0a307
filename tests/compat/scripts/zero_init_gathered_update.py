"""A model built under `deepspeed.zero.Init`, given its weights inside `GatheredParameters` before `initialize`.

Re-created (rewritten, as one script on 2 ranks) from three public uses of `GatheredParameters(..., modifier_rank=r)`
on parameters `zero.Init` partitioned:
- DeepSpeed `tests/unit/runtime/zero/test_zero_context.py` (commit 25f558b041bee99a298fd5c444ae5ecae4ac81c6),
  `TestGatherUpdate`: rank 1 zeroes a weight inside the block, and every rank then reads zeros;
- Megatron-DeepSpeed's layers initialise their weights inside the block from `__init__` (only rank 0's values
  count; here a seeded normal(0, 0.02) as its `init_method`);
- DeepSpeedExamples DeepSpeed-Chat `dschat/utils/utils.py` (commit 70f35772f9b83253d435cabd7bebaaef815b8db3),
  `load_state_dict_into_model`: module by module, its own parameters gathered with `modifier_rank=0` and rank 0
  calling `module._load_from_state_dict`.
Every parameter is set by one of them, so the model is the same under both libraries; it then trains 4 steps at
ZeRO-3 and reports its losses, with the zeroed weight's sum of |values| after the load. Changed from upstream:
the model (an embedding, two layers, a head), fp32 and `torch_adam` (CPU). The library is a switch:
COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import importlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))

VOCAB, WIDTH = 64, 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        with deepspeed.zero.GatheredParameters(self.embed.weight, modifier_rank=0):
            if dist.get_rank() == 0:  # Megatron's init_method, on the rank whose values count
                with torch.no_grad():
                    self.embed.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))


def checkpoint() -> dict[str, torch.Tensor]:
    """The weights DeepSpeed-Chat would read from a file (all but the embedding and the head's bias)."""
    generator = torch.Generator().manual_seed(11)
    state = {}
    for i in range(2):
        state[f"layers.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5
        state[f"layers.{i}.bias"] = torch.randn(WIDTH, generator=generator) * 0.1
    state["head.weight"] = torch.randn(VOCAB, WIDTH, generator=generator) / WIDTH**0.5
    return state


def load_into(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Module by module: its own parameters gathered, rank 0 loading the keys it has."""

    def load(module: nn.Module, prefix: str) -> None:
        own = dict(module.named_parameters(prefix=prefix[:-1], recurse=False))
        gathered = [own[k] for k in state if k in own]
        if gathered:
            with deepspeed.zero.GatheredParameters(gathered, modifier_rank=0):
                if dist.get_rank() == 0:
                    module._load_from_state_dict(state, prefix, {}, False, [], [], [])
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(model, "")


def main() -> None:
    deepspeed.init_distributed()
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):  # the config's dtype (fp32); bare, DeepSpeed picks bf16
        model = Net()
    with deepspeed.zero.GatheredParameters(model.head.bias, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                model.head.bias.zero_()
    with deepspeed.zero.GatheredParameters(model.head.bias):
        zeroed = model.head.bias.detach().abs().sum().item()
    load_into(model, checkpoint())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(4):
        generator = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, (4, 8), generator=generator)
        loss = engine(ids, torch.roll(ids, 1, dims=1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": {"train": losses, "zeroed_bias_abs_sum": [zeroed]}}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
