"""build_optimizer / optimizer_defaults / Lion: DeepSpeed name and key semantics, elementwise-only policy."""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard.errors import ConfigError
from zeroshard.optim import Lion, build_optimizer, optimizer_defaults, supported_optimizer_names


def _groups(*sizes: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"params": [torch.randn(n, generator=gen).requires_grad_()]} for n in sizes]


# ---------------------------------------------------------------------------------------------------------
# Adam / AdamW mapping
# ---------------------------------------------------------------------------------------------------------


def test_adam_means_adamw_with_fused_adam_defaults() -> None:
    opt = build_optimizer("Adam", {"lr": 1e-3}, _groups(8))
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.0  # FusedAdam's default, not torch AdamW's 0.01
    assert opt.defaults["fused"] is True  # CPU has fused kernels in torch >= 2.4


def test_adam_w_mode_false_gives_l2_adam_but_not_for_adamw() -> None:
    assert type(build_optimizer("adam", {"adam_w_mode": False}, _groups(4))) is torch.optim.Adam
    # DeepSpeed: the name AdamW forces decoupled decay whatever adam_w_mode says.
    assert type(build_optimizer("AdamW", {"adam_w_mode": False}, _groups(4))) is torch.optim.AdamW


def test_torch_adam_uses_torch_defaults() -> None:
    opt = build_optimizer("Adam", {"torch_adam": True}, _groups(4))
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["weight_decay"] == 0.01


def test_ds_only_adam_keys_are_consumed() -> None:
    opt = build_optimizer(
        "ADAM",
        {
            "lr": 2e-4,
            "betas": [0.8, 0.95],
            "eps": 1e-6,
            "weight_decay": 0.1,
            "bias_correction": True,
            "set_grad_none": True,
            "fp32_optimizer_states": True,
            "amsgrad": True,
        },
        _groups(4),
    )
    assert opt.defaults["betas"] == (0.8, 0.95)
    assert opt.defaults["amsgrad"] is True
    with pytest.raises(ConfigError, match="torch_adam"):
        build_optimizer("Adam", {"bias_correction": False, "torch_adam": True}, _groups(4))
    with pytest.raises(ConfigError, match="amsgrad"):
        build_optimizer("Adam", {"bias_correction": False, "amsgrad": True}, _groups(4))
    with pytest.raises(ConfigError, match="adam_w_mode"):
        build_optimizer("Adam", {"adam_w_mode": "yes"}, _groups(4))


def test_foreach_fallback_when_no_fused_kernels() -> None:
    meta = [{"params": [torch.empty(4, device="meta", requires_grad=True)]}]
    opt = build_optimizer("Adam", {}, meta)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_user_choice_of_implementation_is_respected() -> None:
    opt = build_optimizer("AdamW", {"foreach": False}, _groups(4))
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]


def test_adam_matches_reference_adamw() -> None:
    groups, ref_groups = _groups(1000, 7), _groups(1000, 7)
    opt = build_optimizer("Adam", {"lr": 1e-2, "weight_decay": 0.1}, groups)
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        for g, r in zip(groups, ref_groups, strict=True):
            grad = torch.randn(g["params"][0].shape, generator=torch.Generator().manual_seed(step))
            g["params"][0].grad, r["params"][0].grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for g, r in zip(groups, ref_groups, strict=True):
        torch.testing.assert_close(g["params"][0], r["params"][0], rtol=1e-6, atol=1e-7)


def _deepspeed_adam_reference(
    init: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, adamw: bool, bias_correction: bool
) -> torch.Tensor:
    """DeepSpeed's CPU Adam kernel (csrc/adam/cpu_adam_impl.cpp) in float64: corrections of 1 without the flag."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    p, m, v = init.double(), torch.zeros_like(init, dtype=torch.float64), torch.zeros_like(init, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 / (1 - b2**t) ** 0.5 if bias_correction else 1.0
        if adamw:
            p = p - lr * wd * p
        else:
            g = g + wd * p
        m = m * b1 + g * (1 - b1)
        v = v * b2 + g * g * (1 - b2)
        p = p - lr / bc1 * m / (v.sqrt() * bc2 + eps)
    return p


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_bias_correction_false_matches_deepspeeds_kernel(adam_w_mode: bool) -> None:
    """`bias_correction: false` (FusedAdam / DeepSpeedCPUAdam's flag) against DeepSpeed's kernel arithmetic."""
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(3000, generator=gen)
    grads = [torch.randn(3000, generator=gen) * 10**-k for k in range(6)]  # down to the scale of eps
    params = {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": adam_w_mode}
    results = {}
    for flag in (True, False):
        w = init.clone().requires_grad_()
        opt = build_optimizer("Adam", {**params, "bias_correction": flag}, [{"params": [w]}])
        for g in grads:
            w.grad = g.clone()
            opt.step()
        expected = _deepspeed_adam_reference(init, grads, 1e-2, 0.1, adam_w_mode, bias_correction=flag)
        torch.testing.assert_close(w.detach().double(), expected, rtol=1e-6, atol=1e-7)
        results[flag] = w.detach()
    assert (results[True] - results[False]).abs().max() > 1e-3  # the flag changes the update


@pytest.mark.slow  # builds DeepSpeed's CPU Adam extension (JIT, 75-150 s the first time)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_bias_correction_false_against_deepspeed_cpu_adam(adam_w_mode: bool) -> None:
    """DeepSpeedCPUAdam(bias_correction=False) itself. Its fp32 kernel rounds in its own order (AVX, step size
    folded in): over 6 steps it lands up to ~2e-6 (a few ulps of values ~2-4) from the float64 evaluation of its
    own formula, where ours lands within 1e-6; torch's bias-corrected AdamW shows the same spread against it. So
    the comparison bounds both by their distance to the float64 reference, which is only fp32 rounding."""
    from helpers.deepspeed_reference import import_deepspeed

    ds_cpu_adam = import_deepspeed("deepspeed.ops.adam").DeepSpeedCPUAdam
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(3000, generator=gen)
    grads = [torch.randn(3000, generator=gen) * 10**-k for k in range(6)]
    theirs, ours = init.clone().requires_grad_(), init.clone().requires_grad_()
    ds_opt = ds_cpu_adam([theirs], lr=1e-2, weight_decay=0.1, bias_correction=False, adamw_mode=adam_w_mode)
    params = {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": False, "adam_w_mode": adam_w_mode}
    our_opt = build_optimizer("Adam", params, [{"params": [ours]}])
    for g in grads:
        theirs.grad, ours.grad = g.clone(), g.clone()
        ds_opt.step()
        our_opt.step()
    expected = _deepspeed_adam_reference(init, grads, 1e-2, 0.1, adam_w_mode, bias_correction=False)
    torch.testing.assert_close(ours.detach().double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(theirs.detach().double(), expected, rtol=1e-6, atol=4e-6)
    assert float((theirs - ours).norm() / ours.norm()) < 2e-6


def test_bias_correction_false_is_elementwise() -> None:
    _assert_flat_steps_as_its_pieces("Adam", {"lr": 0.01, "weight_decay": 0.1, "bias_correction": False})


# ---------------------------------------------------------------------------------------------------------
# Names and keys
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("sgd", torch.optim.SGD),
        ("Adagrad", torch.optim.Adagrad),
        ("rmsprop", torch.optim.RMSprop),
        ("NAdam", torch.optim.NAdam),
        ("radam", torch.optim.RAdam),
        ("Adamax", torch.optim.Adamax),
        ("lion", Lion),
    ],
)
def test_names_are_case_insensitive(name: str, cls: type) -> None:
    assert type(build_optimizer(name, {"lr": 0.01}, _groups(4))) is cls


@pytest.mark.parametrize(
    "name",
    [
        "LBFGS",
        "SparseAdam",
        "OneBitAdam",
        "ZeroOneAdam",
        "OneBitLamb",
        "Adafactor",
    ],
)
def test_non_elementwise_optimizers_are_refused(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_optimizer(name, {}, _groups(4))
    message = str(err.value)
    assert "optimizer.type" in message and repr(name) in message and "elementwise" in message
    assert "Supported:" in message and "AdamW" in message


def test_unknown_name_suggests() -> None:
    with pytest.raises(ConfigError, match=r"optimizer.type='Adamm'.*Did you mean 'Adam'.*Supported:"):
        build_optimizer("Adamm", {}, _groups(4))


def test_unknown_param_is_named() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.betaz .*Did you mean 'betas'"):
        build_optimizer("Adam", {"betaz": [0.9, 0.99]}, _groups(4))
    with pytest.raises(ConfigError, match=r"optimizer\.params\.adam_w_mode"):
        build_optimizer("SGD", {"adam_w_mode": True}, _groups(4))


def test_max_grad_norm_points_to_gradient_clipping() -> None:
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer("Adam", {"max_grad_norm": 1.0}, _groups(4))


def test_adagrad_amsgrad_false_is_consumed_true_is_refused() -> None:
    assert type(build_optimizer("adagrad", {"amsgrad": False}, _groups(4))) is torch.optim.Adagrad
    with pytest.raises(ConfigError, match="amsgrad"):
        build_optimizer("adagrad", {"amsgrad": True}, _groups(4))


def test_invalid_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr: -1\.0 is out of range"):
        build_optimizer("SGD", {"lr": -1.0}, _groups(4))
    with pytest.raises(ConfigError, match="optimizer.params is invalid"):  # a rule only the constructor knows
        build_optimizer("SGD", {"nesterov": True}, _groups(4))


# LAMB's trust ratio reads whole parameters: a flat tensor needs its plan (test_lamb_on_a_flat_tensor_with_its_plan)
@pytest.mark.parametrize("name", [n for n in supported_optimizer_names() if n != "Lamb"])
def test_every_supported_optimizer_is_elementwise(name: str) -> None:
    """Stepping one flat tensor equals stepping the tensors it concatenates (what ZeRO relies on)."""
    _assert_flat_steps_as_its_pieces(name, {"lr": 0.01, "weight_decay": 0.1} if name != "Rprop" else {"lr": 0.01})


_SIZES = (5, 3, 8)


def _assert_flat_steps_as_its_pieces(name: str, params: dict, with_plan: bool = False) -> None:
    """Three steps of optimizer `name` over one flat tensor equal three over the tensors it concatenates (`with_plan`:
    the flat tensor's optimizer is told where its parameters lie, as LAMB's strategies tell it)."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(n, generator=gen) for n in _SIZES]
    pieces = [t.clone().requires_grad_() for t in init]
    flat = torch.cat(init).requires_grad_()
    split_opt = build_optimizer(name, params, [{"params": pieces}])
    flat_opt = build_optimizer(name, params, [{"params": [flat]}])
    if with_plan:
        flat_opt.plan = _OnePlan(flat, _SIZES)
    for _ in range(3):
        grads = [torch.randn(n, generator=gen) for n in _SIZES]
        for p, g in zip(pieces, grads, strict=True):
            p.grad = g.clone()
        flat.grad = torch.cat(grads)
        split_opt.step()
        flat_opt.step()
    torch.testing.assert_close(flat.detach(), torch.cat([p.detach() for p in pieces]), rtol=1e-6, atol=1e-7)


class _OnePlan:
    """A flat tensor of one rank holding `sizes` parameters whole, one after another ([Note: LAMB on flat shards])."""

    def __init__(self, flat: torch.Tensor, sizes: tuple[int, ...]):
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.flat, self.pieces = (
            flat,
            [(offset, n, k) for k, (offset, n) in enumerate(zip(offsets, sizes, strict=True))],
        )

    def segments(self, group, stepped):
        return (len(self.pieces), {id(self.flat): self.pieces}) if any(t is self.flat for t in stepped) else (0, {})

    def reduce(self, sums):
        pass


def test_lamb_on_a_flat_tensor_with_its_plan() -> None:
    """Stepping one flat tensor through a plan that names its parameters equals stepping the parameters."""
    _assert_flat_steps_as_its_pieces("Lamb", {"lr": 0.01, "weight_decay": 0.1, "max_coeff": 10.0}, with_plan=True)


def test_lamb_is_deepspeeds_fused_lamb_step() -> None:
    """One step against DeepSpeed's kernel written out (csrc/lamb/fused_lamb_cuda_kernel.cu): moments, u with the
    decay, the clamped |W| / |u|, bias correction in the step size; a zero weight takes the coefficient 1."""
    w = torch.tensor([3.0, 4.0])
    zero = torch.zeros(2)
    g = torch.tensor([0.5, -1.0])
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, 0.1, 0.01
    params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(zero.clone())]
    for p in params:
        p.grad = g.clone()
    build_optimizer(
        "Lamb", {"lr": lr, "weight_decay": wd, "max_coeff": 10.0, "min_coeff": 0.01}, [{"params": params}]
    ).step()
    for start, got in ((w, params[0]), (zero, params[1])):
        m, v = (1 - b1) * g, (1 - b2) * g * g
        u = m / (v.sqrt() + eps) + wd * start
        coeff = min(max(float(start.norm() / u.norm()), 0.01), 10.0) if start.norm() > 0 else 1.0
        step_size = lr * math.sqrt(1 - b2) / (1 - b1)
        torch.testing.assert_close(got.detach(), start - step_size * coeff * u)


# ---------------------------------------------------------------------------------------------------------
# Lion
# ---------------------------------------------------------------------------------------------------------


def _lion_reference(
    p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, lr: float, b1: float, b2: float, wd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    update = torch.sign(b1 * m + (1 - b1) * g)
    return p - lr * (update + wd * p), b2 * m + (1 - b2) * g


def test_lion_matches_chen_et_al() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(100, generator=gen), torch.randn(50, generator=gen)
    frozen = torch.randn(4, generator=gen).requires_grad_()
    opt = build_optimizer(
        "Lion",
        {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1},
        [
            {"params": [a.clone().requires_grad_(), frozen]},
            {"params": [b.clone().requires_grad_()], "lr": 0.02},
        ],
    )
    refs = [(a.clone(), torch.zeros_like(a), 0.01), (b.clone(), torch.zeros_like(b), 0.02)]
    for _ in range(4):
        live = [opt.param_groups[0]["params"][0], opt.param_groups[1]["params"][0]]
        grads = [torch.randn(t.shape, generator=gen) for t in live]
        for p, g in zip(live, grads, strict=True):
            p.grad = g
        opt.step()
        refs = [(*_lion_reference(p, m, g, lr, 0.9, 0.99, 0.1), lr) for (p, m, lr), g in zip(refs, grads, strict=True)]
    for (p_ref, m_ref, _), group in zip(refs, opt.param_groups, strict=True):
        p = group["params"][0]
        torch.testing.assert_close(p.detach(), p_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m_ref, rtol=1e-6, atol=1e-7)
        assert opt.state[p]["step"] == 4
    assert frozen not in opt.state  # no grad, no state, untouched


def test_lion_sign_of_zero_is_zero() -> None:
    w = torch.ones(3, requires_grad=True)
    opt = Lion([w], lr=0.1)
    w.grad = torch.tensor([1.0, -1.0, 0.0])
    opt.step()
    assert w.detach().tolist() == pytest.approx([0.9, 1.1, 1.0])


def test_lion_rejects_bad_hyperparameters() -> None:
    with pytest.raises(ConfigError):
        build_optimizer("Lion", {"betas": [1.5, 0.9]}, _groups(4))
    with pytest.raises(ConfigError, match=r"optimizer\.params\.eps"):
        build_optimizer("Lion", {"eps": 1e-8}, _groups(4))


# ---------------------------------------------------------------------------------------------------------
# optimizer_defaults
# ---------------------------------------------------------------------------------------------------------


def test_optimizer_defaults() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    assert optimizer_defaults(torch.optim.AdamW(p, lr=3e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)) == {
        "lr": 3e-4,
        "betas": (0.8, 0.9),
        "eps": 1e-6,
        "weight_decay": 0.2,
    }
    assert optimizer_defaults(torch.optim.SGD(p, lr=0.1)) == {"lr": 0.1, "weight_decay": 0}
    assert optimizer_defaults(Lion(p)) == {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}
    tensor_lr = optimizer_defaults(torch.optim.Adam(p, lr=torch.tensor(0.5)))
    assert tensor_lr["lr"] == 0.5 and isinstance(tensor_lr["lr"], float)
