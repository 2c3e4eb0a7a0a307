"""Checkpoints saved without a tag are found through `latest`; loading from a folder without one is a no-op.

Re-created (as plain functions run on 2 ranks, rewritten) from DeepSpeed
`tests/unit/checkpoint/test_latest_checkpoint.py` and the part of `tests/unit/checkpoint/common.py`
(`checkpoint_correctness_verification`) it uses, commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641.
Kept as upstream: the config (train_batch_size, "Adam" lr 0.00015), `initialize(config=, model=,
model_parameters=)`, `save_checkpoint(folder, tag=None)`, `load_checkpoint(folder, tag=None,
load_optimizer_states=True, load_lr_scheduler_states=False, load_module_only=False)` into a second engine, the
module and optimizer states compared, and `load_checkpoint(empty_dir)` returning without loading.
Changed: `train_batch_size` is 2 per rank, `torch_adam: true` so that DeepSpeed does not JIT-build FusedAdam;
both engines then train two more steps and the losses are reported (they must agree).
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import importlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_loss(self.linears[0](x), y)


CONFIG = {
    "train_batch_size": 4,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "torch_adam": True}},
}
HIDDEN = 10


def random_batches(count: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return [
        (torch.randn(2, HIDDEN, generator=generator), torch.randint(0, HIDDEN, (2,), generator=generator))
        for _ in range(count)
    ]


def train(engine, batches: list) -> list[float]:
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def check_existing_latest(tmpdir: str) -> list[float]:
    torch.manual_seed(0)
    models = [SimpleModel(hidden_dim=HIDDEN) for _ in range(2)]
    trained, _, _, _ = deepspeed.initialize(config=CONFIG, model=models[0], model_parameters=models[0].parameters())
    losses = train(trained, random_batches(25, seed=1))

    save_folder = os.path.join(tmpdir, "saved_checkpoint")
    trained.save_checkpoint(save_folder, tag=None)
    dist.barrier()

    loaded, _, _, _ = deepspeed.initialize(config=CONFIG, model=models[1], model_parameters=models[1].parameters())
    assert list(trained.parameters())[0].dtype == list(loaded.parameters())[0].dtype
    loaded.load_checkpoint(
        save_folder,
        tag=None,
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
        load_module_only=False,
    )
    for (name, p0), (_, p1) in zip(trained.module.named_parameters(), loaded.module.named_parameters(), strict=True):
        assert torch.equal(p0, p1), f"{name} differs after loading the latest checkpoint"
    more = random_batches(2, seed=50)
    after_trained, after_loaded = train(trained, more), train(loaded, more)
    assert after_trained == after_loaded, (after_trained, after_loaded)
    return losses + after_loaded


def check_missing_latest(tmpdir: str) -> list[float]:
    torch.manual_seed(0)
    model = SimpleModel(HIDDEN)
    model, _, _, _ = deepspeed.initialize(config=CONFIG, model=model, model_parameters=model.parameters())
    before = [p.detach().clone() for p in model.module.parameters()]
    # a no-op: the folder has no `latest`
    model.load_checkpoint(tmpdir)
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters(), strict=True))
    return train(model, random_batches(2, seed=7))


def main() -> None:
    deepspeed.init_distributed()
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    results = {
        "existing_latest": check_existing_latest(os.path.join(root, "existing")),
        "missing_latest": check_missing_latest(os.path.join(root, "missing")),
    }
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": results}), flush=True)


if __name__ == "__main__":
    main()
