"""DeepSpeed's tensor-fragment API (`deepspeed.utils.safe_get_*` / `safe_set_*` / `safe_update_full_grad_vectorized`)
between backward and step, and after the step, at ZeRO stages 1-3, with and without the optimizer offloaded.

Re-created (as plain functions run on 2 ranks, rewritten) from DeepSpeed
`tests/unit/runtime/zero/test_zero_tensor_fragment.py`, commit 0fe2dfcc73edc61acddd906c7da1c37d78bf3f60:
`TestTensorFragmentGet` (every trainable parameter has a full or, at stage 3, local fp32 value, gradient and Adam
moments; a frozen one has none), `TestTensorFragmentSet` (random values broadcast from rank 0 are set through the full
or local API and read back exactly: weight and gradient between backward and step, weight and moments after it) and
`TestTensorFragmentUpdate` (gradients replaced through `safe_update_full_grad_vectorized`).
Changed: fp32 and bf16 only (DeepSpeed refuses fp16 on the CPU) and no NVMe (DeepSpeed's would JIT-build its aio
op; zeroshard's NVMe tier is tested in tests/distributed/test_set_grad.py); a hidden size of 16 and 4 samples
(upstream sizes the model by the NVMe swap threshold); the random values come from a seeded generator (upstream:
the global one, which the two libraries' start-ups consume differently); "Adam" gets `torch_adam: true` so that
DeepSpeed does not JIT-build its Adam. After the step the values set are read back, then the ones read before are
set again: DeepSpeed's `safe_set_full_fp32_param` changes the weights the next forward uses only at the next step,
zeroshard's at once (docs/compat.md), and the losses are compared. A stage-3 model is built under `zero.Init`, whose
initial values differ between the libraries: the set runs report their losses from the second step on (after the
weights were set), the get and update runs (which set no weights) and the local set runs (a rank's part of a
parameter is where its unit splits it in zeroshard, an even split of each parameter in DeepSpeed, so the random parts
make different wholes) are compared for finiteness only.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import importlib
import json
import os

import torch
import torch.distributed as dist

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
ds_utils = importlib.import_module(f"{deepspeed.__name__}.utils")

HIDDEN = 16
SAMPLES = 4
WEIGHT, GRADIENT = "weight", "gradient"


class MyModel(torch.nn.Module):
    def __init__(self, hidden_dim: int, frozen_weights: bool) -> None:
        super().__init__()
        self.act = torch.nn.ReLU()
        self.cel = torch.nn.CrossEntropyLoss()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, hidden_dim)]
        )
        if frozen_weights:
            self.linears[0].weight.requires_grad = False
            self.linears[0].bias.requires_grad = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = self.act(layer(x))
        return self.cel(x, y)


class SimpleModel(torch.nn.Module):
    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_loss(self.linears[0](x), y)


def config(stage: int, offload: bool, dtype: torch.dtype) -> dict:
    out: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if offload:
        out["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype == torch.bfloat16:
        out["bf16"] = {"enabled": True}
    if stage == 3:
        out["zero_optimization"]["param_persistence_threshold"] = HIDDEN
    return out


def build(model_class, stage: int, settings: dict, *args):
    torch.manual_seed(0)
    with deepspeed.zero.Init(enabled=stage == 3, config_dict_or_path=settings):
        return model_class(*args)


def run(model, settings: dict, dtype: torch.dtype, after_backward, after_step) -> list[float]:
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for step in range(SAMPLES):
        x = torch.randn(1, HIDDEN, generator=generator).to(engine.device, dtype)
        y = torch.randint(0, HIDDEN, (1,), generator=generator).to(engine.device)
        loss = engine(x, y)
        engine.backward(loss)
        after_backward(engine.module, step)
        engine.step()
        after_step(engine.module, step)
        losses.append(loss.item())
    engine.destroy()
    return losses


# -- TestTensorFragmentGet -------------------------------------------------------------------------------------------
def validate_present(model, api: str, opt_states: bool) -> None:
    for _, lp in model.named_parameters():
        keys = ["exp_avg", "exp_avg_sq"] if opt_states else [WEIGHT, GRADIENT]
        values = [read(lp, key, api) for key in keys]
        if lp.requires_grad:
            assert all(v is not None for v in values)
        else:
            assert all(v is None for v in values)


def check_get(stage: int, offload: bool, api: str, frozen: bool) -> list[float]:
    settings = config(stage, offload, torch.float32)
    model = build(MyModel, stage, settings, HIDDEN, frozen)
    return run(
        model,
        settings,
        torch.float32,
        lambda m, step: validate_present(m, api, opt_states=False),
        lambda m, step: validate_present(m, api, opt_states=True),
    )


# -- TestTensorFragmentSet / Update ----------------------------------------------------------------------------------
def random_values(model, keys: list[str], grad_dtype: torch.dtype, api: str, step: int) -> dict:
    """Per parameter and key: random values of its full shape (broadcast from rank 0) or, for the local API, of its
    local part's shape (each rank its own)."""
    generator = torch.Generator().manual_seed(1000 * step + (dist.get_rank() if api == "local" else 0))
    out: dict = {}
    for name, lp in model.named_parameters():
        shape = lp.ds_tensor.shape if api == "local" else (lp.ds_shape if hasattr(lp, "ds_id") else lp.shape)
        out[name] = {}
        for key in keys:
            dtype = grad_dtype if key == GRADIENT else torch.float32
            value = torch.rand(shape, generator=generator).to(lp.device, dtype)
            if api == "full":
                dist.broadcast(value, src=0)
            out[name][key] = value
    return out


def read(lp, key: str, api: str):
    """`safe_get_{api}_*` of `key`: the gradient, the fp32 weight or an optimizer state."""
    if key in (GRADIENT, WEIGHT):
        return getattr(ds_utils, f"safe_get_{api}_{'grad' if key == GRADIENT else 'fp32_param'}")(lp)
    return getattr(ds_utils, f"safe_get_{api}_optimizer_state")(lp, key)


def write(lp, key: str, value, api: str) -> None:
    """`safe_set_{api}_*` of `key`."""
    if key in (GRADIENT, WEIGHT):
        getattr(ds_utils, f"safe_set_{api}_{'grad' if key == GRADIENT else 'fp32_param'}")(lp, value)
    else:
        getattr(ds_utils, f"safe_set_{api}_optimizer_state")(lp, value, key)


def set_and_validate(model, values: dict, api: str) -> None:
    for name, lp in model.named_parameters():
        for key, value in values[name].items():
            write(lp, key, value, api)
    for name, lp in model.named_parameters():
        for key, value in values[name].items():
            assert torch.equal(value, read(lp, key, api)), (name, key, api)


def update_and_validate(model, values: dict) -> None:
    new = {id(lp): values[name][GRADIENT] for name, lp in model.named_parameters()}
    ds_utils.safe_update_full_grad_vectorized(list(model.parameters()), lambda old, param: new[id(param)])
    for name, lp in model.named_parameters():
        assert torch.equal(values[name][GRADIENT], ds_utils.safe_get_full_grad(lp)), name


def check_set(stage: int, offload: bool, dtype: torch.dtype, api: str, update: bool = False) -> list[float]:
    settings = config(stage, offload, dtype)
    model = build(SimpleModel, stage, settings, HIDDEN)

    def after_backward(m, step: int) -> None:
        if update:
            update_and_validate(m, random_values(m, [GRADIENT], dtype, "full", step))
        else:
            set_and_validate(m, random_values(m, [WEIGHT, GRADIENT], dtype, api, step), api)

    def after_step(m, step: int) -> None:
        if update:
            return
        keys = [WEIGHT, "exp_avg", "exp_avg_sq"]
        before = {name: {key: read(lp, key, api) for key in keys} for name, lp in m.named_parameters()}
        set_and_validate(m, random_values(m, keys, dtype, api, step + 500), api)
        set_and_validate(m, before, api)  # see the header: the next forward's weights are the step's in both

    return run(model, settings, dtype, after_backward, after_step)


def main() -> None:
    deepspeed.init_distributed()
    results = {}
    for stage in (1, 2, 3):
        for offload in (False, True):
            where = f"stage{stage}_{'cpu' if offload else 'none'}"
            for api in ("full", "local") if stage == 3 else ("full",):
                for frozen in (False, True):
                    results[f"get_{where}_{api}_frozen{int(frozen)}"] = check_get(stage, offload, api, frozen)
                for dtype in (torch.float32, torch.bfloat16):
                    losses = check_set(stage, offload, dtype, api)
                    results[f"set_{where}_{api}_{str(dtype)[6:]}"] = losses[1:] if stage == 3 else losses
            results[f"update_{where}"] = check_set(stage, offload, torch.float32, "full", update=True)
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": results}), flush=True)


if __name__ == "__main__":
    main()
