"""Muon with an auxiliary Adam: ds_config `"optimizer": {"type": "Muon"}`, as DeepSpeed 0.19.8's MuonWithAuxAdam.

Muon (K. Jordan et al. 2024, "Muon: MomentUm Orthogonalized by Newton-Schulz") steps a weight matrix W with

    m      = lerp(m, g, 1 - momentum)                  (momentum, elementwise)
    u      = lerp(g, m, momentum)                      (Nesterov, elementwise)
    O      = NS5(u) * sqrt(max(1, rows / cols))        (the nearest semi-orthogonal matrix, whole-matrix)
    W      = W * (1 - lr * weight_decay) - lr * O

where NS5 is five quintic Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315) on u scaled to unit
Frobenius norm. Matrices (two or more dimensions, their names without "embed" or "lm_head": DeepSpeed's rule) take
this step; every other trainable parameter takes AdamW (torch's fused kernel where it has one).

[Note: Muon on flat shards]
ZeRO hands the optimizer one flat tensor per parameter group ([Note: elementwise optimizers only] in
optimizers.py), so the whole-matrix step cannot run on a shard alone. The momentum and the Nesterov blend are
elementwise and run on the shard. The orthogonalisation asks the optimizer's `MatrixPlan`, set by the strategy
that built the tensors: which matrices their elements belong to, and how to make each matrix whole. Stage 0 holds
every matrix whole; at stages 1-2 (one flat master per group, zero/matrices.py) and stage 3 (one master per unit and
group, stepped a sub-group at a time, zero/stage3/matrices.py) each matrix is sent, piece by piece, to one rank
(balanced by Newton-Schulz cost), orthogonalised there, and its pieces sent back. Every rank calls the plan for every
Muon group in each step, holding pieces or not, so the exchanges pair up. Without a plan each tensor is its own
matrix (the optimizer over ordinary parameters, as in a single process). Because the pieces are put back together
exactly, the update of every element is the one the single-process optimizer computes: the parity tests compare
bit for bit.

Groups: initialize splits each parameter group into its Muon and Adam halves (`half_options`, as DeepSpeed's
`_muon_param_groups`): the config's shared keys, then `muon_lr` / `adam_lr`, then the group's own options, each half
keeping only its keys (Muon: lr, momentum, weight_decay, ns_method; Adam: lr, betas, eps, weight_decay). Missing
values take MuonWithAuxAdam's defaults (Muon: lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"; Adam: lr
3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0). `adam_w_mode: false` gives the Adam half coupled (L2) decay.

Newton-Schulz precision: on CUDA "gram" iterates in fp16 and "standard" in bf16, as DeepSpeed; on the CPU both in
fp32 (DeepSpeed's CPU accelerator picks bf16 for "standard", whose matmuls run ~60x slower than fp32 on the CPUs we
measured). "gram" (T. Dao's Gram Newton-Schulz) iterates on the small square Gram matrix with a restart after two
iterations; square matrices take the standard iteration.

Differences from DeepSpeed: the step follows the overflow check, so a skipped step leaves the momentum alone
(DeepSpeed folds the gradient into it during the reduction and guards it with an isfinite test); gradient clipping
scales the gradients before the step, at every stage, as DeepSpeed's stage 0 and a single-process
`clip_grad_norm_` do (DeepSpeed's stages 1-2 compute the norm over the orthogonalised updates instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.closure import evaluate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_KEYS = (*MUON_KEYS, "betas", "eps", "muon_lr", "adam_lr", "adam_w_mode", "per_head_muon")
MUON_DEFAULTS: Mapping[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS: Mapping[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def uses_muon(name: str, shape: Sequence[int]) -> bool:
    """Whether a trainable parameter takes the Muon step: DeepSpeed's rule (a matrix, not an embedding or head)."""
    lowered = name.lower()
    return len(shape) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def check_params(params: Mapping[str, Any]) -> None:
    """ConfigError naming the first `optimizer.params` key Muon does not take, or a value it cannot use."""
    for key in params:
        if key not in CONFIG_KEYS:
            raise ConfigError(
                f"optimizer.params.{key} is not a Muon parameter; Muon takes {', '.join(CONFIG_KEYS)} "
                "(lr, momentum, weight_decay, ns_method for matrices; betas, eps for the Adam half; muon_lr and "
                "adam_lr override lr for one half)"
            )
    if params.get("per_head_muon", False) is not False:
        raise ConfigError(
            "optimizer.params.per_head_muon is not implemented (DeepSpeed's per-attention-head Newton-Schulz); "
            "remove it to orthogonalise each projection whole"
        )
    if params.get("ns_method", "gram") not in NS_METHODS:
        raise ConfigError(f"optimizer.params.ns_method must be one of {list(NS_METHODS)}, got {params['ns_method']!r}")
    if not isinstance(params.get("adam_w_mode", True), bool):
        raise ConfigError(f"optimizer.params.adam_w_mode must be true or false, got {params['adam_w_mode']!r}")


def half_options(params: Mapping[str, Any], group: Mapping[str, Any], muon: bool) -> dict[str, Any]:
    """One half's options: the config's shared keys, then `muon_lr`/`adam_lr`, then the group's own (DeepSpeed's
    order), only the keys that half takes."""
    keys = MUON_KEYS if muon else ADAM_KEYS
    options = {key: params[key] for key in keys if key in params}
    override = "muon_lr" if muon else "adam_lr"
    if override in params:
        options["lr"] = params[override]
    options.update({key: value for key, value in group.items() if key in keys})
    return {"use_muon": muon, **options}


class MatrixPlan(Protocol):
    """Which matrices the flat tensors a strategy hands the optimizer hold ([Note: Muon on flat shards])."""

    def orthogonalized(
        self, group: int, blended: dict[int, torch.Tensor], orthogonalize: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """For each tensor of optimizer group `group` being stepped (`blended`: by `id` of the tensor, its elements),
        its update: every matrix made whole, `orthogonalize`d, and cut back; elements of no matrix are 0. Collective:
        every rank calls it for every Muon group in each step, with what it steps (possibly nothing)."""
        ...


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon`, Adam (decoupled unless `adam_w_mode` is false) for the others.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.eye(2))
        >>> b = torch.nn.Parameter(torch.zeros(2))
        >>> opt = Muon([{"params": [w], "use_muon": True, "lr": 0.1}, {"params": [b], "use_muon": False}])
        >>> w.grad, b.grad = torch.eye(2), torch.ones(2)
        >>> _ = opt.step()
        >>> [round(v, 4) for v in w.detach().diagonal().tolist()]
        [0.8892, 0.8892]
    """

    def __init__(self, params: Iterable[dict[str, Any]], adam_w_mode: bool = True) -> None:
        groups = [dict(group) for group in params]
        for group in groups:
            group.setdefault("use_muon", False)
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            _check_group(group)
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.plan: MatrixPlan | None = None  # set by the strategy that built the flat tensors (attach)
        adam_groups = self._adam_groups()
        self._adam: torch.optim.Optimizer | None = None
        if adam_groups:
            cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
            fused = _fused_available(adam_groups)
            self._adam = cls(adam_groups, fused=fused or None, foreach=None if fused else True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of every parameter that has a gradient: Muon groups, then the Adam half."""
        loss = evaluate(closure)
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_step(index, group)
        if self._adam is not None and any(p.grad is not None for g in self._adam_groups() for p in g["params"]):
            # load_state_dict replaces the group dicts and the state: the Adam half follows them
            self._adam.param_groups = self._adam_groups()
            self._adam.state = self.state
            for group in self._adam.param_groups:
                for key, value in self._adam.defaults.items():
                    group.setdefault(key, value)
            self._adam.step()
        return loss

    def _adam_groups(self) -> list[dict[str, Any]]:
        return [group for group in self.param_groups if not group["use_muon"]]

    def _muon_step(self, index: int, group: dict[str, Any]) -> None:
        stepped = [p for p in group["params"] if p.grad is not None]
        blended = {}
        for param in stepped:
            grad = param.grad
            assert grad is not None
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            momentum, beta = state["momentum_buffer"], group["momentum"]
            momentum.lerp_(grad, 1 - beta)
            blended[id(param)] = grad.lerp(momentum, beta)  # Nesterov
        method = group["ns_method"]
        if self.plan is not None:
            updates = self.plan.orthogonalized(index, blended, lambda matrix: orthogonalize(matrix, method))
        else:  # ordinary parameters: each is its own matrix
            updates = {id(p): orthogonalize(_matrix(p, blended[id(p)]), method) for p in stepped}
        for param in stepped:
            param.mul_(1 - group["lr"] * group["weight_decay"])
            update = updates.get(id(param))  # none: the tensor holds no matrix element (padding, an empty stand-in)
            if update is not None:
                param.add_(update.reshape(param.shape), alpha=-group["lr"])


def _matrix(param: torch.Tensor, blended: torch.Tensor) -> torch.Tensor:
    if param.dim() < 2:
        raise ValueError(f"a Muon group holds a {param.dim()}-d tensor and no strategy says which matrices it holds")
    return blended


def orthogonalize(update: torch.Tensor, method: str) -> torch.Tensor:
    """Newton-Schulz of `update` times sqrt(max(1, rows / cols)), in `update`'s dtype and shape (a 4-d convolution
    filter as (out, rest), its scale from its last two dimensions, as DeepSpeed; a 3-d tensor batched)."""
    rows, cols = update.shape[-2], update.shape[-1]
    matrix = update.reshape(len(update), -1) if update.dim() == 4 else update
    dtype = ns_dtype(method, update.device)
    out = _gram_newton_schulz(matrix, dtype) if method == "gram" else _newton_schulz(matrix, dtype)
    out = out * (math.sqrt(rows / cols) if rows > cols else 1.0)
    return out.to(update.dtype).reshape(update.shape)


def ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype Newton-Schulz iterates in: DeepSpeed's on CUDA, fp32 elsewhere (module docstring)."""
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def _newton_schulz(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _gram_newton_schulz(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same iteration on R = X X^T (n x n, n the smaller side): X_k = Q_k X_0, with a restart (X = Q X) after
    two iterations to keep half precision stable; the normalisation runs in fp32 when the input is fp16."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.float32 if matrix.dtype == torch.float16 else matrix.dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if x.size(-1) <= x.size(-2):  # square: no saving
        for _ in range(NS_STEPS):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.mT if tall else x
    gram = x @ x.mT
    q: torch.Tensor | None = None
    restart = 2
    for i in range(NS_STEPS):
        if i == restart:
            assert q is not None
            x = q @ x
            gram = x @ x.mT
            q = None
        z = b * gram + c * gram @ gram
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < NS_STEPS - 1 and i + 1 != restart:
            rz = a * gram + z @ gram
            gram = a * rz + z @ rz
    assert q is not None
    return x.mT @ q.mT if tall else q @ x


def _check_group(group: Mapping[str, Any]) -> None:
    if group["use_muon"]:
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Muon: ns_method must be one of {list(NS_METHODS)}, got {group['ns_method']!r}")
        if not 0.0 <= float(group["momentum"]) < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {group['momentum']}")
    for key in ("lr", "weight_decay"):
        if float(group[key]) < 0.0:
            raise ValueError(f"Muon: {key} must be >= 0, got {group[key]}")


def _fused_available(groups: list[dict[str, Any]]) -> bool:
    from zeroshard.optim.optimizers import _fused_kernels_available

    return _fused_kernels_available(groups)
