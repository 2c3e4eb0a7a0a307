"""[Note: initialisation recorded under zero_init]: what a model's code computes or writes under `zero_init` is what
its materialised tensors hold (custom parameters from factories, writes in a parent's `__init__`, init loops,
`apply` with a free function, views, buffers), the same as the model built whole where the code is deterministic and
the same distribution where it draws; standard layers keep `reset_parameters()`'s values bit for bit; a write the
replay cannot run is named."""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
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


def test_values_follow_the_seed_set_before_construction() -> None:
    """Each random call draws from its own seed (the generator's seed and the calls recorded under it before): the
    values do not depend on the unit's seed or on which module is materialised first; a copy of a tensor replays the
    same draws; another seed gives another model, and so does the next model under the same seed."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
            self.teacher = copy.deepcopy(self.student)  # an EMA teacher starts as its student
            self.register_buffer("features", torch.randn(16, 8))  # random features, not unit 0's draws

    from zeroshard.loading.replay import Replay, bindings

    torch.manual_seed(3)
    with zero_init():
        model = Pair()
        following = Pair()
    torch.manual_seed(4)
    with zero_init():
        other = Pair()
    last = model.student[2]  # replayed alone first, under another global random state
    alone = {n: torch.empty_like(p, device="cpu") for n, p in last.named_parameters()}
    torch.manual_seed(99)
    Replay(CPU).fill([(alone[n], b) for n, b in bindings(last, dict(last.named_parameters())).items()])
    first, other, following = _materialise(model, seed=0), _materialise(other), _materialise(following)
    assert all(torch.equal(alone[n], p) for n, p in last.named_parameters())
    for (name, a), c in zip(first.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, c) == (a.unique().numel() == 1), name  # another seed, other draws
    assert not torch.equal(following.student[0].weight, first.student[0].weight)
    for a, b in zip(first.student.parameters(), first.teacher.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.features[:8], first.student[0].weight)
    assert 0.9 < first.features.std().item() < 1.1


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


def test_device_moves_in_the_block_leave_the_placement_to_the_engine() -> None:
    """[Note: device moves under zero_init]: `.cpu()`, `.to(device)`, `.cuda()` inside the block (DeepSpeed's
    TestSerialParamInit builds `Son().cpu()`) keep the meta tensors; a move with a dtype keeps the dtype; the values
    are the constructor's."""
    with zero_init():
        moved = _Norm(4).cpu().to("cpu").to(torch.device("cpu"), torch.float64)
        by_tensor = _Norm(4).to(torch.zeros(1, dtype=torch.bfloat16))
        on_meta = _Norm(4).to("meta")
    for model, dtype in ((moved, torch.float64), (by_tensor, torch.bfloat16), (on_meta, torch.float32)):
        assert all(p.is_meta and p.dtype == dtype for p in model.parameters()), model
        _materialise(model)
        assert model.weight.dtype == dtype and model.weight.eq(1).all() and model.bias.eq(0).all()


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


def test_default_dtype_views_and_shared_buffers() -> None:
    """A model built under another default dtype (transformers' `from_config(dtype=...)`) replays in it; a storage
    read as another dtype (the real part of a complex rotary table) and a buffer two modules share replay too."""

    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            freqs = 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))
            cis = torch.polar(torch.ones(6, 4), torch.outer(torch.arange(6).float(), freqs))
            self.register_buffer("cis", torch.stack([cis.real, cis.imag], dim=-1), persistent=False)
            self.register_buffer("pairs", torch.view_as_real(cis).clone(), persistent=False)

    class Block(nn.Module):
        def __init__(self, mask: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("mask", mask)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            mask = torch.full((4, 4), float("-inf")).triu_(1)  # one mask for every block
            self.blocks = nn.ModuleList(Block(mask) for _ in range(2))
            self.lin = nn.Linear(4, 4)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with zero_init():
            half = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    finally:
        torch.set_default_dtype(previous)
    _materialise(half)
    assert half[0].weight.dtype == torch.bfloat16 and half[1].weight.eq(1).all()
    for cls in (Rope, Shared):
        whole = cls()
        with zero_init():
            model = cls()
        _materialise(model)
        expected = dict(whole.named_buffers(remove_duplicate=False))
        for name, value in model.named_buffers(remove_duplicate=False):
            assert torch.equal(value, expected.pop(name)), name
        assert not expected


def test_real_arguments_are_copied_when_recorded() -> None:
    """A real tensor or array given to a recorded call is kept as it was then; a replay does not write into it, and
    replaying twice (a block before initialize, then initialize) gives the same values."""
    from zeroshard.loading.replay import Replay, bindings

    init = torch.ones(4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            array = np.arange(4, dtype=np.float32)
            self.register_buffer("x", torch.tensor(array))
            array *= 10
            scratch = torch.zeros(3, device="cpu")
            self.a, self.b = nn.Parameter(torch.empty(3)), nn.Parameter(torch.empty(3))
            with torch.no_grad():
                scratch.fill_(1.0)
                self.a.copy_(scratch)
                scratch.fill_(2.0)
                self.b.copy_(scratch)
            self.gamma = nn.Parameter(torch.as_tensor(init))
            self.scale = nn.Parameter(torch.as_tensor(np.ones(4, dtype=np.float32)))  # shares the array's memory
            with torch.no_grad():
                self.gamma.mul_(2.0)
                self.scale.mul_(2.0)

    with zero_init():
        model = Model()
    found = bindings(model, {"gamma": model.gamma, "scale": model.scale})
    twice = [torch.empty(4) for _ in range(4)]
    for k, out in enumerate(twice):
        Replay(CPU).fill([(out, found["gamma" if k % 2 else "scale"])])
    _materialise(model)
    assert model.x.tolist() == [0, 1, 2, 3] and model.a.tolist() == [1, 1, 1] and model.b.tolist() == [2, 2, 2]
    assert model.gamma.tolist() == [2, 2, 2, 2] and model.scale.tolist() == [2, 2, 2, 2] and init.tolist() == [1] * 4
    assert all(t.tolist() == [2, 2, 2, 2] for t in twice)


def test_init_functions_that_skip_the_meta_device() -> None:
    """`trunc_normal_`, `orthogonal_`, `dirac_` return on the meta device before dispatching: recognised at their
    `is_meta` check (timm's ViT, torchtitan); layers cloned by `copy.deepcopy` (nn.TransformerEncoder) are bound;
    `inplace=True` writes count; a seeded generator gives each call its own draws."""

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(1, 64, 32))
            nn.init.trunc_normal_(self.pos_embed, std=0.02, a=-0.03, b=0.03)
            self.rot = nn.Parameter(torch.empty(16, 16))
            nn.init.orthogonal_(self.rot)
            self.conv = nn.Conv2d(4, 4, 3, bias=False)
            nn.init.dirac_(self.conv.weight)
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
            self.shift = nn.Parameter(torch.full((8,), -1.0))
            with torch.no_grad():
                nn.functional.relu(self.shift, inplace=True)
            g = torch.Generator().manual_seed(42)
            self.z, self.a = nn.Linear(16, 16), nn.Linear(16, 16)
            nn.init.normal_(self.z.weight, generator=g)
            nn.init.normal_(self.a.weight, generator=g)

    whole = ViT()
    with zero_init():
        model = ViT()
    _materialise(model)
    assert 0.013 < model.pos_embed.std().item() < 0.017 and model.pos_embed.abs().max().item() <= 0.03  # 1.5 std
    assert torch.allclose(model.rot @ model.rot.T, torch.eye(16), atol=1e-5)
    assert torch.equal(model.conv.weight, whole.conv.weight)
    for name, p in model.encoder.named_parameters():  # xavier and the layers' own init, not zeros
        expected = dict(whole.encoder.named_parameters())[name]
        if expected.dim() > 1:
            assert 0.8 < p.std().item() / expected.std().item() < 1.25, name
    assert model.shift.eq(0).all()
    assert not torch.equal(model.z.weight, model.a.weight) and 0.8 < model.z.weight.std().item() < 1.25


def test_long_chains_nested_modes_and_the_generator_untouched() -> None:
    """A buffer computed through hundreds of calls and a recurrence over rows replay (in recorded order: no
    recursion, no copies of old versions); an init function that returns early on the meta device is seen through a
    torch function mode entered inside the block (transformers' own `torch.device("meta")`); recording draws
    nothing from the default generator."""

    class Chains(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            x = torch.ones(4)
            for _ in range(400):
                x = x * 1.01
            self.register_buffer("chain", x)
            rows = torch.ones(64, 8)
            for i in range(1, 64):
                rows[i] = rows[i - 1] * 0.99
            self.register_buffer("rows", rows)
            self.lin = nn.Linear(8, 8)
            nn.init.trunc_normal_(self.lin.weight, std=0.02)

    whole = Chains()
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    with zero_init():
        with torch.device("meta"):
            model = Chains()
    assert torch.equal(torch.rand(3), expected)
    _materialise(model)
    assert torch.allclose(model.chain, whole.chain) and torch.equal(model.rows, whole.rows)
    assert 0.013 < model.lin.weight.std().item() < 0.027


def test_recurrent_layers_materialise() -> None:
    """torch's RNN layers keep weak references to their weights (swap_tensors refused them: "Cannot swap t1 because
    it has weakref"); they materialise, with their own initialisation, and run."""
    with zero_init():
        model = nn.Sequential(nn.LSTM(8, 16, num_layers=2, batch_first=True))
    _materialise(model)
    lstm = model[0]
    bound = 1 / math.sqrt(16)
    assert all(p.abs().max().item() <= bound and p.std().item() > 0.5 * bound / math.sqrt(3) for p in lstm.parameters())
    assert lstm(torch.randn(2, 5, 8))[0].shape == (2, 5, 16)


def test_transformers_initialisation_is_recorded_where_it_runs() -> None:
    """transformers skips `initialize_weights` on the meta device: it is run and recorded at that moment, children
    before parents as transformers runs it, so a parent's branch reaches its children (CLIP's projections and patch
    embedding, written from modules that own a parameter themselves); a seed set for a moment inside the block does
    not make later draws repeat earlier ones."""
    from transformers import CLIPConfig, CLIPModel

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(vocab_size=128, max_position_embeddings=16, **sizes),
        vision_config=dict(image_size=32, patch_size=8, **sizes),
        projection_dim=32,
    )
    whole = CLIPModel(config)
    with zero_init():
        model = CLIPModel(config)
    _materialise(model)
    expected = dict(whole.named_parameters())
    for name, p in model.named_parameters():
        if expected[name].std() > 0:
            assert 0.75 < p.std().item() / expected[name].std().item() < 1.33, name
        else:
            assert torch.equal(p, expected[name]), name

    class Scoped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(1000) * 0.02)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(123)
                self.register_buffer("projection", torch.randn(8, 8))
            self.b = nn.Parameter(torch.randn(1000) * 0.02)

    with zero_init():
        scoped = Scoped()
    _materialise(scoped)
    assert not torch.equal(scoped.a, scoped.b)


def test_transformers_init_that_reads_values_runs_after_the_replay(caplog: pytest.LogCaptureFixture) -> None:
    """An `_init_weights` that reads a value (`.item()`) cannot run on the meta device: the model still builds, what
    its attempt wrote is dropped, and `_init_weights` runs module by module on real tensors, as before."""
    from transformers import PretrainedConfig, PreTrainedModel

    class ReadingConfig(PretrainedConfig):
        model_type = "zeroshard-reading"

    class Reading(PreTrainedModel):
        config_class = ReadingConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0.0, 0.3)
                module.bias.data.fill_(module.weight.std().item())

    logging.getLogger("zeroshard").addHandler(caplog.handler)  # zeroshard's logger does not propagate
    try:
        with zero_init():
            model = Reading(ReadingConfig())
    finally:
        logging.getLogger("zeroshard").removeHandler(caplog.handler)
    assert caplog.text.count("Reading's _init_weights cannot run on the meta device") == 1
    _materialise(model)
    for layer in (model.a, model.b):
        assert 0.27 < layer.weight.std().item() < 0.33
        assert torch.allclose(layer.bias, layer.weight.std().expand(64))
