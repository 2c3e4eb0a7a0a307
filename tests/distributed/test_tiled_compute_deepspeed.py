"""Tiled compute with the import swapped: the body of DeepSpeed's own test (tests/unit/ulysses_alst/
test_tiled_compute.py: a stack of two MLPs and an lm_head, 125 and 425 tokens so the last slice is short) run with
DeepSpeed 0.19.8 and with zeroshard, at ZeRO stages 2 and 3 and a batch of 2, in fp32: in each framework the tiled
model's loss equals the untiled one's bit for bit and its gradients are close (DeepSpeed's own assertions), with no
gradient-layout warning; across frameworks the same losses and gradients. And one difference: a GPT whose embedding
is tied to lm_head, under the tiled loss at ZeRO-2, stops DeepSpeed at the shared weight's second gradient
("has already been reduced"); zeroshard reduces it once more ([Note: gradients after their bucket's reduction])."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch
from torch.nn import CrossEntropyLoss, Linear, Module, ReLU

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks

STAGES = [2, 3]
BATCH = 2


class SimpleMLP(Module):
    def __init__(self, hidden_dim: int):
        super().__init__()
        self.up_proj = Linear(hidden_dim, hidden_dim * 2, bias=False)
        self.down_proj = Linear(hidden_dim * 2, hidden_dim, bias=False)
        self.act = ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MyModel(Module):
    def __init__(self, hidden_dim: int, vocab_size: int, forward_mode: str, api: Any):
        super().__init__()
        self.vocab_size = vocab_size
        self.mlp1 = SimpleMLP(hidden_dim)
        self.mlp2 = SimpleMLP(hidden_dim)
        self.lm_head = Linear(hidden_dim, vocab_size, bias=False)
        self.cross_entropy_loss = CrossEntropyLoss()
        self.mode, self.api = forward_mode, api

    def _mlp(self, mlp: SimpleMLP, x: torch.Tensor) -> torch.Tensor:
        params = [mlp.down_proj.weight, mlp.up_proj.weight]
        if self.mode == "tiled_mlp":
            return self.api.TiledMLP.apply(SimpleMLP.forward, mlp, x, 4, params)
        if self.mode == "sequence_tiled_compute":
            return self.api.sequence_tiled_compute(
                SimpleMLP.forward, x.shape[1], 4, {"x": x}, {"self": mlp}, "x", params, 1, None
            )
        return mlp(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self._mlp(self.mlp2, self._mlp(self.mlp1, x))

        def loss_fn(self: MyModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self.lm_head(x)
            return self.cross_entropy_loss(logits.view(-1, self.vocab_size), y.view(-1))

        if self.mode == "tiled_loss":
            return self.api.TiledFusedLogitsLoss.apply(loss_fn, self, x, y, None, 2, [self.lm_head.weight], "mean")
        return loss_fn(self, x, y)


def _run(deepspeed: Any, stage: int, mode: str, hidden: int, vocab: int, seqlen: int) -> dict[str, Any]:
    api = importlib.import_module(f"{deepspeed.__name__}.runtime.sequence_parallel.ulysses_sp")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    torch.manual_seed(42)
    x = torch.rand((BATCH, seqlen, hidden), requires_grad=True)
    y = torch.empty((BATCH, seqlen), dtype=torch.long).random_(vocab)
    torch.manual_seed(42)
    model = MyModel(hidden, vocab, mode, api)
    engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    x = x.clone().detach().requires_grad_(True)
    loss = engine(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.backward(loss)
    names = ["mlp1.up_proj.weight", "mlp2.up_proj.weight", "lm_head.weight"]
    grads = {n: deepspeed.utils.safe_get_full_grad(dict(engine.module.named_parameters())[n]) for n in names}
    layout = [str(w.message) for w in caught if "gradient layout contract" in str(w.message)]
    engine.destroy()
    return {"loss": loss.detach(), "x_grad": x.grad.clone(), "grads": grads, "layout_warnings": layout}


def _script(deepspeed: Any) -> dict[tuple[int, str], dict[str, Any]]:
    out = {}
    for stage in STAGES:
        for mode in ("plain", "tiled_mlp", "sequence_tiled_compute"):
            out[(stage, mode)] = _run(deepspeed, stage, mode, hidden=128, vocab=10, seqlen=125)
        for mode in ("plain_loss", "tiled_loss"):
            out[(stage, mode)] = _run(deepspeed, stage, mode, hidden=64, vocab=100, seqlen=425)
    return out


def _tied(deepspeed: Any) -> str:
    """One step of the tied, tiled GPT at ZeRO-2; what stopped it, if anything."""
    from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch
    from helpers.tiled import tile

    case = Case(stage=2, steps=1)
    api = importlib.import_module(f"{deepspeed.__name__}.runtime.sequence_parallel.ulysses_sp")
    model = tile(build_model(case), "listed", "fused", api)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case))
    try:
        engine.backward(engine(*micro_batch(global_batches(case, 1)[0], 0, 0, 1, case.micro)))
        engine.step()
    except AssertionError as error:
        return str(error)
    return "trained"


def _both(rank: int, world_size: int) -> dict[str, Any]:
    deepspeed = import_deepspeed()
    import_deepspeed("deepspeed.runtime.sequence_parallel.ulysses_sp")
    import zeroshard

    deepspeed.init_distributed(dist_backend="gloo")
    out = {"ds": _script(deepspeed), "ours": _script(zeroshard)}
    return {**out, "tied": {"ours": _tied(zeroshard), "ds": _tied(deepspeed)}}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b)  # DeepSpeed's torch_assert_close: torch's default fp32 tolerances


def test_deepspeed_tiled_compute_script_with_the_import_swapped() -> None:
    (runs,) = run_on_ranks(_both, 1, timeout=600)
    for framework in ("ds", "ours"):
        got = runs[framework]
        for stage in STAGES:
            for base, tiled in [
                ("plain", "tiled_mlp"),
                ("plain", "sequence_tiled_compute"),
                ("plain_loss", "tiled_loss"),
            ]:
                a, b = got[(stage, base)], got[(stage, tiled)]
                assert not b["layout_warnings"], (framework, stage, tiled, b["layout_warnings"])
                if tiled == "tiled_loss":
                    _close(a["loss"], b["loss"])  # DeepSpeed's test: "usually an exact match, but on cpu CI..."
                else:
                    assert torch.equal(a["loss"], b["loss"]), (framework, stage, tiled)
                _close(a["x_grad"], b["x_grad"])
                names = ["lm_head.weight"] if tiled == "tiled_loss" else ["mlp1.up_proj.weight", "mlp2.up_proj.weight"]
                for name in names:
                    _close(a["grads"][name], b["grads"][name])
    assert runs["tied"]["ours"] == "trained"
    assert "gpt.wte.weight has already been reduced" in runs["tied"]["ds"], runs["tied"]["ds"]
    for key, ds in runs["ds"].items():
        ours = runs["ours"][key]
        assert torch.equal(ds["loss"], ours["loss"]), key
        _close(ds["x_grad"], ours["x_grad"])
        for name, grad in ds["grads"].items():
            _close(grad, ours["grads"][name])
