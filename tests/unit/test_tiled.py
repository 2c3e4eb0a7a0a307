"""Tiled compute ([Note: tiled compute]) without a process group: each tiled form computes the untiled function's
output and gradients; it equals DeepSpeed's bit for bit where DeepSpeed is right, and differs where DeepSpeed's
TiledFusedLogitsLoss loses the factor applied to the loss; slices, flags, errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.runtime.sequence_parallel import ulysses_sp as zs

HIDDEN, VOCAB = 16, 10


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


MLP_FORWARD = MLP.forward


def _inputs(bs: int, seq: int = 13) -> tuple[MLP, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.rand(bs, seq, HIDDEN, requires_grad=True)
    return MLP(), nn.Linear(HIDDEN, VOCAB, bias=False), x, torch.randint(0, VOCAB, (bs, seq))


def _grads(out: torch.Tensor, x: torch.Tensor, *modules: nn.Module) -> list[torch.Tensor]:
    """out's value, then the gradients of (out * out).sum() (a scalar out: of out itself, times 3)."""
    x.grad = None
    for m in modules:
        m.zero_grad()
    (out * out).sum().backward() if out.dim() else (3 * out).backward()
    return [out.detach(), x.grad.clone()] + [p.grad.clone() for m in modules for p in m.parameters()]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _token_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).view(-1, VOCAB), y.reshape(-1), reduction="sum")


@pytest.mark.parametrize("bs", [1, 2])
def test_each_tiled_form_computes_the_untiled_function(bs: int) -> None:
    mlp, head, x, y = _inputs(bs)
    want = _grads(mlp(x), x, mlp)
    _close(_grads(zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 4, [mlp.up.weight, mlp.down.weight]), x, mlp), want)
    _close(_grads(zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 4, None), x, mlp), want)
    _close(_grads(zs.AutogradComputeMLP.apply(MLP_FORWARD, mlp, x), x, mlp), want)
    generic = zs.sequence_tiled_compute(MLP_FORWARD, 13, 4, {"x": x}, {"self": mlp}, "x", None, 1, None)
    _close(_grads(generic, x, mlp), want)
    # the reductions of a non-loss output: DeepSpeed fails on these
    for reduction, reduce in (("mean", torch.mean), ("sum", torch.sum)):
        want_r = _grads(reduce(mlp(x)), x, mlp)
        got = zs.sequence_tiled_compute(MLP_FORWARD, 13, 4, {"x": x}, {"self": mlp}, "x", None, 1, reduction)
        _close(_grads(got, x, mlp), want_r)
    loss_want = _grads(_token_loss(head, x, y) / y.numel(), x, head)
    loss = zs.TiledFusedLogitsLoss.apply(_token_loss, head, x, y, None, 3, [head.weight], "sum") / y.numel()
    _close(_grads(loss, x, head), loss_want)
    per_slice = zs.sequence_tiled_compute(
        _token_loss, 13, 3, {"x": x, "y": y}, {"head": head}, "x", [head.weight], 0, "sum"
    )
    _close(_grads(per_slice / y.numel(), x, head), loss_want)


def test_bit_equal_to_deepspeed_and_right_where_deepspeed_loses_the_loss_factor() -> None:
    ds = import_deepspeed("deepspeed.runtime.sequence_parallel.ulysses_sp")
    mlp, head, x, y = _inputs(1)
    params = [mlp.up.weight, mlp.down.weight]
    for mod in (ds, zs):  # DeepSpeed's test forms (tests/unit/ulysses_alst/test_tiled_compute.py), bs 1, 4 slices
        got = _grads(mod.TiledMLP.apply(MLP_FORWARD, mlp, x, 4, params), x, mlp)
        generic = mod.sequence_tiled_compute(MLP_FORWARD, 13, 4, {"x": x}, {"self": mlp}, "x", params, 1, None)
        got += _grads(generic, x, mlp)
        if mod is ds:
            want = got
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    def mean_loss(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(x).view(-1, VOCAB), y.reshape(-1))

    results = {}
    for name, mod in (("ds", ds), ("zs", zs)):
        x.grad, head.weight.grad = None, None
        loss = mod.TiledFusedLogitsLoss.apply(mean_loss, head, x, y, None, 4, [head.weight], "mean")
        (loss / 2).backward()  # gradient accumulation over 2 micro-steps divides the loss so
        results[name] = (loss.detach(), x.grad.clone(), head.weight.grad.clone())
    x.grad, head.weight.grad = None, None
    slices = zip(x.view(13, HIDDEN).chunk(4), y.view(13).chunk(4), strict=True)
    loss = torch.stack([mean_loss(head, a, b) for a, b in slices]).mean()
    (loss / 2).backward()
    for name in ("ds", "zs"):
        assert torch.equal(results[name][0], loss.detach()) and torch.equal(results[name][1], x.grad)
    torch.testing.assert_close(results["zs"][2], head.weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results["ds"][2], 2 * head.weight.grad, rtol=1e-6, atol=1e-7)  # DeepSpeed's error


def test_weights_are_flagged_not_ready_until_the_last_slice_even_when_chunk_gives_fewer() -> None:
    mlp, _, x, _ = _inputs(1, seq=9)  # 9 tokens in 4 shards: torch.chunk gives 3 slices of 3
    seen: list[bool] = []
    mlp.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.ds_grad_is_ready))
    zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 4, None).sum().backward()
    assert seen == [False, False, True]
    seen.clear()
    out = zs.sequence_tiled_compute(MLP_FORWARD, 9, 4, {"x": x}, {"self": mlp}, "x", [mlp.up.weight], 1, None)
    out.sum().backward()  # slices of ceil(9 / 4) = 3: the fourth would be empty and is skipped
    assert seen == [False, False, True]


def test_weights_get_gradients_when_the_input_needs_none_and_flags_survive_a_failure() -> None:
    mlp, _, x, _ = _inputs(2)
    out = zs.TiledMLP.apply(MLP_FORWARD, mlp, x.detach(), 4, None)
    assert out.requires_grad  # the first layer of a model with frozen embeddings
    out.sum().backward()
    assert mlp.up.weight.grad is not None and mlp.up.weight.grad.abs().sum() > 0
    calls = []

    def fails_in_backward(self: MLP, piece: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        if len(calls) > 5:  # forward's 4 slices ran; backward's second slice raises
            raise RuntimeError("slice failed")
        return MLP_FORWARD(self, piece)

    out = zs.TiledMLP.apply(fails_in_backward, mlp, x, 4, None)
    with pytest.raises(RuntimeError, match="slice failed"):
        out.sum().backward()
    assert all(p.ds_grad_is_ready for p in mlp.parameters())


def test_no_gradient_layout_warning_with_a_batch_of_two() -> None:
    mlp, head, x, y = _inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 4, None).sum().backward()
        zs.TiledFusedLogitsLoss.apply(_token_loss, head, x, y, None, 3, None, "sum").backward()


def test_bad_arguments_are_named() -> None:
    mlp, head, x, y = _inputs(1)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 0, None)
    with pytest.raises(ValueError, match="unknown output_reduction 'avg'"):
        zs.sequence_tiled_compute(MLP_FORWARD, 13, 2, {"x": x}, {"self": mlp}, "x", None, 1, "avg")
    with pytest.raises(ValueError, match="'h' is not a key of kwargs_to_shard"):
        zs.sequence_tiled_compute(MLP_FORWARD, 13, 2, {"x": x}, {"self": mlp}, "h", None, 1, None)
    with pytest.raises(ValueError, match="'y' requires grad but only 'x'"):
        zs.sequence_tiled_compute(lambda x, y: x + y, 13, 2, {"x": x, "y": x.clone()}, {}, "x", None, 1, None)
    with pytest.raises(ValueError, match="unknown output_reduction None"):
        zs.TiledFusedLogitsLoss.apply(_token_loss, head, x, y, None, 2, None, None)
    with pytest.raises(ValueError, match="mask must be"):
        zs.TiledFusedLogitsLoss.apply(_token_loss, head, x, y, torch.ones(13), 2, None, "sum")
    with pytest.raises(ValueError, match="x and y differ"):
        zs.TiledFusedLogitsLoss.apply(_token_loss, head, x, y[:, :5], None, 2, None, "sum")
    with pytest.raises(ValueError, match="2 values for 1 keys"):
        zs.SequenceTiledCompute.apply(MLP_FORWARD, 13, 2, ["x"], [], "x", None, 1, None, x, mlp)


class DropoutMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.dropout(F.relu(self.up(x)), 0.5))


@pytest.mark.parametrize("autocast", [False, True])
def test_the_recompute_replays_the_random_state_and_autocast(autocast: bool) -> None:
    mlp, _, x, _ = _inputs(1, seq=4)
    results = []
    for tiled in (False, True):
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = zs.AutogradComputeMLP.apply(DropoutMLP.forward, mlp, x) if tiled else DropoutMLP.forward(mlp, x)
        results.append(_grads(out.float(), x, mlp))
        results[-1].append(torch.rand(3))  # the generator's state after: as if the recompute drew nothing
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_weight_the_last_slice_skips_is_still_handed_on_ready() -> None:
    _, head, x, y = _inputs(1, seq=12)
    y = y.clone()
    y[0, 8:] = -100  # the last of 3 slices: every target masked

    def guarded(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * 0).sum() if bool((y == -100).all()) else _token_loss(head, x, y)

    seen: list[bool] = []
    head.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.ds_grad_is_ready))
    zs.TiledFusedLogitsLoss.apply(guarded, head, x, y, None, 3, None, "sum").backward()
    assert seen == [False, False, True]  # the last: zeros accumulated with the flag set, the held sum handed on
    got = head.weight.grad.clone()
    head.zero_grad()
    _token_loss(head, x[:, :8], y[:, :8]).backward()
    torch.testing.assert_close(got, head.weight.grad, rtol=1e-5, atol=1e-6)


def test_nested_tiled_calls_keep_an_outer_hold_and_autograd_grad_is_refused() -> None:
    mlp, _, x, _ = _inputs(1)
    for p in mlp.parameters():
        p.ds_grad_is_ready = False  # an enclosing tiled call's hold
    seen: list[bool] = []
    mlp.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.ds_grad_is_ready))
    zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 2, None).sum().backward()
    assert seen == [False, False] and not any(p.ds_grad_is_ready for p in mlp.parameters())
    out = zs.TiledMLP.apply(MLP_FORWARD, mlp, x, 2, None).sum()
    with pytest.raises(RuntimeError, match="not torch.autograd.grad"):
        torch.autograd.grad(out, x)
    with pytest.raises(ValueError, match="0-d loss per slice"):
        zs.TiledFusedLogitsLoss.apply(lambda h, x, y: h(x), mlp, x, x[..., 0], None, 2, None, "mean")
