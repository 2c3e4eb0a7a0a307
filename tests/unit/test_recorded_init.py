"""[Note: initialisation recorded under zero_init]: what a model's code computes or writes under `zero_init` is what
its materialised tensors hold (custom parameters from factories, writes in a parent's `__init__`, init loops,
`apply` with a free function, views, buffers), the same as the model built whole where the code is deterministic and
the same distribution where it draws; standard layers keep `reset_parameters()`'s values bit for bit; a write the
replay cannot run is named."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zeroshard import zero_init
from zeroshard.errors import ZeroshardError
from zeroshard.loading.materialize import initialise, materialize_buffers

CPU = torch.device("cpu")


class _Norm(nn.Module):
    """nanoGPT's LayerNorm: parameters from factories, no reset_parameters."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))


def _zero_rows(m: nn.Module) -> None:
    if isinstance(m, nn.Embedding):
        with torch.no_grad():
            m.weight[:2].zero_()  # a view's write


class _Model(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.norm = _Norm(d)
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 8)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        self.bn = nn.BatchNorm1d(d)
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)).view(1, 6, 6))
        pe = torch.zeros(10, d)
        position = torch.arange(10).unsqueeze(1).float()
        pe[:, 0::2] = torch.sin(position * torch.exp(torch.arange(0, d, 2).float() * (-math.log(1e4) / d)))
        self.register_buffer("pe", pe, persistent=False)
        self.apply(_zero_rows)  # a free function, as DeepSpeed's override_module_apply serves
        nn.init.zeros_(self.head.weight)  # adaLN-Zero style: a parent writes a built child's parameter
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.startswith("proj.") and name.endswith("weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))


def _materialise(model: nn.Module, seed: int = 0) -> nn.Module:
    materialize_buffers(model, None, CPU)
    named = [(n, p) for n, p in model.named_parameters()]
    initialise(dict(model.named_modules()), [n for n, _ in named], [p for _, p in named], CPU, seed)
    return model


def test_constructor_values_survive_zero_init() -> None:
    whole = _Model()
    with zero_init():
        model = _Model()
    assert all(p.is_meta for p in model.parameters())
    _materialise(model)
    values = dict(model.named_parameters()) | dict(model.named_buffers())
    expected = dict(whole.named_parameters()) | dict(whole.named_buffers())
    for name in ("norm.weight", "norm.bias", "head.weight", "mask", "pe", "bn.running_var", "bn.running_mean"):
        assert torch.equal(values[name], expected[name]), name
    assert values["norm.weight"].eq(1).all()  # was zeros: a custom module without reset_parameters
    assert values["emb.weight"][:2].eq(0).all() and values["emb.weight"][2:].ne(0).all()
    assert 0.015 < values["pos"].std().item() < 0.025  # randn * 0.02, not zeros
    scaled = 0.02 / math.sqrt(6)
    for k in range(3):  # the loop's std, not Linear's kaiming bound (std ~0.072 at d=64)
        assert 0.8 * scaled < values[f"proj.{k}.weight"].std().item() < 1.2 * scaled
        assert 0.06 < values[f"blocks.{k}.weight"].std().item() < 0.085


def test_standard_layers_keep_reset_parameters_values() -> None:
    """A model of torch's layers replays what their reset_parameters() does, in that order: bit for bit the values
    `initialise` gave before recording existed."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(11, 8, padding_idx=1), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))

    with zero_init():
        model = build()
    _materialise(model, seed=5)
    reference = build()
    modules = dict(reference.named_modules())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + 5)
        for name in sorted({n.rsplit(".", 1)[0] for n, _ in reference.named_parameters()}):
            modules[name].reset_parameters()  # type: ignore[operator]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_versions_and_dtype_casts() -> None:
    """A call reads a tensor as it was then; a later write to it does not change that; a cast after construction
    keeps the values."""

    class Versions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            x = torch.full((4,), 3.0)
            self.before = nn.Parameter(x.clone())
            x.zero_()
            self.after = nn.Parameter(x)
            self.shared = nn.Parameter(torch.arange(6.0).view(2, 3).t())  # a view as the parameter

    with zero_init():
        model = Versions().to(torch.bfloat16)
    _materialise(model)
    assert model.before.dtype == torch.bfloat16 and model.before.eq(3).all()
    assert model.after.eq(0).all()
    assert torch.equal(model.shared, torch.arange(6.0, dtype=torch.bfloat16).view(2, 3).t())


def test_uninitialised_tensors_keep_module_initialisation() -> None:
    """`torch.empty` that nothing wrote is not an initialisation: the module's reset_parameters() runs, as before."""

    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))

        def reset_parameters(self) -> None:
            nn.init.constant_(self.weight, 0.5)

    with zero_init():
        model = Lazy()
        cast = Lazy().to(torch.bfloat16)  # a cast of nothing written is nothing written
    _materialise(model)
    _materialise(cast)
    assert model.weight.eq(0.5).all() and cast.weight.eq(0.5).all()


def test_transformers_init_weights_runs_after_the_replay() -> None:
    """transformers skips `_init_weights` on the meta device; it runs after the replay, as after construction."""
    from helpers.hf_trainer import tiny_llama

    whole = tiny_llama()
    with zero_init():
        model = tiny_llama()
    _materialise(model)
    std = model.config.initializer_range
    q = model.model.layers[0].self_attn.q_proj.weight
    assert 0.8 * std < q.std().item() < 1.2 * std  # not the kaiming bound of reset_parameters (~0.1 here)
    assert model.model.norm.weight.eq(1).all()
    rotary = dict(model.named_buffers())
    for name, value in whole.named_buffers():
        assert torch.equal(rotary[name], value), name


def test_replay_failure_names_the_call() -> None:
    """The meta device checks no values: an index out of range passes there and fails in the replay, named."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            with torch.no_grad():
                self.weight[torch.tensor([7])] = 2.0

    with zero_init():
        model = Odd()
    with pytest.raises(ZeroshardError, match=r"replaying __setitem__, which the model's code ran on the meta device"):
        _materialise(model)


def test_recording_ends_with_the_block() -> None:
    depth = torch._C._len_torch_function_stack()
    with zero_init():
        assert torch._C._len_torch_function_stack() == depth + 2  # the meta device, and the recorder
    assert torch._C._len_torch_function_stack() == depth
    after = torch.ones(3)  # not recorded, not on the meta device
    assert not after.is_meta
