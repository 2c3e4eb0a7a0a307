"""Muon's pieces without a process group ([Note: Muon on flat shards] in optim/muon.py, zero/matrices.py): the
Newton-Schulz iterations against DeepSpeed 0.19.8's own, the grouping rules, and the owners' balance."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.optim import muon
from zeroshard.zero.matrices import Piece, ShardedMatrices, _balanced_owners


@pytest.fixture
def deepspeed_muon():
    """DeepSpeed's functions, eager (they are wrapped in torch.compile, which would compile for minutes here)."""
    original_muon = import_deepspeed("deepspeed.runtime.zero.muon.original_muon")
    with torch._dynamo.config.patch(disable=True):
        yield original_muon


@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (32, 32), (128, 32), (3, 40, 24)])
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_the_update_is_deepspeeds_to_the_bit(deepspeed_muon, shape: tuple[int, ...], method: str) -> None:
    torch.manual_seed(0)
    grad, momentum = torch.randn(shape), torch.randn(shape)
    # DeepSpeed's CPU accelerator iterates "gram" in fp32 and "standard" in bf16; ours picks fp32 for both on the CPU,
    # so "standard" is compared in the dtype DeepSpeed uses
    dtype = deepspeed_muon.ns_compute_dtype(method)
    ours_momentum = momentum.lerp(grad, 1 - 0.95)
    blended = grad.lerp(ours_momentum, 0.95)
    if method == "gram":
        ours = muon.orthogonalize(blended, method)
    else:
        rows, cols = shape[-2], shape[-1]
        ours = (muon._newton_schulz(blended, dtype) * (max(1.0, rows / cols) ** 0.5)).to(blended.dtype)
    theirs = deepspeed_muon.muon_update(grad.clone(), momentum_buffer := momentum.clone(), beta=0.95, ns_method=method)
    assert torch.equal(ours_momentum, momentum_buffer)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()


def test_a_convolution_filter_is_orthogonalised_as_out_by_rest() -> None:
    """DeepSpeed 0.19.8 views a 4-d filter as (out, rest) and scales by its last two sizes; its own `muon_update`
    then fails on the filter's shape (a torch.where of the 2-d update against the 4-d gradient), ours returns it."""
    torch.manual_seed(0)
    filt = torch.randn(8, 4, 3, 3)
    out = muon.orthogonalize(filt, "gram")
    assert out.shape == filt.shape
    flat = muon.orthogonalize(filt.reshape(8, 36), "gram")  # wide: scale 1, as the 3x3 kernel's
    assert torch.equal(out.reshape(8, 36), flat)


def test_which_parameters_take_muon() -> None:
    assert muon.uses_muon("blocks.0.mlp.0.weight", (128, 32))
    assert not muon.uses_muon("blocks.0.ln_1.weight", (32,))
    assert not muon.uses_muon("model.embed_tokens.weight", (64, 32))
    assert not muon.uses_muon("lm_head.weight", (64, 32))


def test_each_half_takes_the_config_then_its_lr_then_the_group() -> None:
    params = {"lr": 1e-3, "muon_lr": 0.05, "momentum": 0.9, "betas": [0.9, 0.99], "weight_decay": 0.1}
    group = {"weight_decay": 0.0, "momentum": 0.8, "eps": 1e-6}
    assert muon.half_options(params, group, True) == {
        "use_muon": True,
        "lr": 0.05,
        "momentum": 0.8,
        "weight_decay": 0.0,
    }
    assert muon.half_options(params, group, False) == {
        "use_muon": False,
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "weight_decay": 0.0,
        "eps": 1e-6,
    }


def test_defaults_are_muon_with_aux_adams() -> None:
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    opt = muon.Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    muon_group, adam_group = opt.param_groups
    assert {k: muon_group[k] for k in muon.MUON_DEFAULTS} == dict(muon.MUON_DEFAULTS)
    assert {k: adam_group[k] for k in muon.ADAM_DEFAULTS} == dict(muon.ADAM_DEFAULTS)


def test_the_adam_half_survives_a_state_dict_round_trip() -> None:
    """load_state_dict replaces the group dicts and the state; the Adam half must step the new ones."""
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
    opt = muon.Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False, "lr": 0.1}])
    for _ in range(2):
        w.grad, b.grad = torch.randn(6, 4), torch.randn(4)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # torch's state_dict() hands out the live tensors
    w2, b2 = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(b.detach().clone())
    again = muon.Muon([{"params": [w2], "use_muon": True}, {"params": [b2], "use_muon": False, "lr": 0.1}])
    again.load_state_dict(saved)
    grads = torch.randn(6, 4), torch.randn(4)
    w.grad, b.grad = grads
    w2.grad, b2.grad = (g.clone() for g in grads)
    opt.step()
    again.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
    assert int(again.state[b2]["step"]) == 3


def test_owners_balance_newton_schulz_cost() -> None:
    shapes = [torch.Size(s) for s in [(64, 64), (64, 64), (32, 32), (32, 32), (128, 16)]]
    owners = _balanced_owners(shapes, 2)
    assert owners[0] != owners[1]  # the two largest apart
    assert _balanced_owners(shapes, 2) == owners  # the same on every rank


def test_unsharded_matrices_are_orthogonalised_in_place_of_their_elements() -> None:
    """Stage 0: every piece whole on this rank; padding between and after matrices comes back 0."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 4), torch.randn(3, 5)
    flat = torch.cat([a.reshape(-1), torch.full((2,), 7.0), b.reshape(-1), torch.full((3,), 7.0)])
    pieces = [[Piece(0, 0, 24, 0), Piece(1, 0, 15, 26)]]
    source = ShardedMatrices([a.shape, b.shape], pieces, None, torch.device("cpu"))
    out = source.apply(flat, lambda m: muon.orthogonalize(m, "gram"))
    assert torch.equal(out[:24], muon.orthogonalize(a, "gram").reshape(-1))
    assert torch.equal(out[26:41], muon.orthogonalize(b, "gram").reshape(-1))
    assert not out[24:26].any() and not out[41:].any()
