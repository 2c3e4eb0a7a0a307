"""Single-process reference training and the engine-side runner used by the parity tests.

The reference is plain PyTorch: the same model and seed, the whole global batch (world_size x
gradient_accumulation_steps micro-batches) per step, fp32 master weights with torch's AdamW and
`clip_grad_norm_`. For bf16 it keeps a bf16 working copy for forward/backward and accumulates its
gradients in fp32, which is what the engine does.

[Note: parameters without a gradient]
Flat ZeRO shards give a parameter that received no gradient in a step a zero gradient (its Adam
moments decay and weight decay applies), as DeepSpeed does. The reference zero-fills such
gradients so the two agree by definition rather than by accident.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from zeroshard.models.gpt import GPT, Block, GPTConfig

# bias=False: an attention key bias has an exactly-zero true gradient (softmax ignores a per-query
# constant), so its computed gradient is rounding noise that Adam normalises into +-lr steps; any
# change of summation order then sends it elsewhere. Without biases every parameter has a real
# gradient and fp32 parity is a meaningful 1e-6 check.
TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
DEEP = replace(TINY, n_layer=6)  # enough units that some are reduced, and stepped, while backward still runs
FP16_LOSS_SCALE = 128.0  # static: no step is skipped, so a reference without a dynamic scaler matches


@dataclass(frozen=True)
class Case:
    stage: int
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (static loss scale FP16_LOSS_SCALE; only with master "fp16")
    gas: int = 1
    micro: int = 2
    steps: int = 5  # each one compared; 5 (8 before) keep multi-step state (Adam moments, swapped shards) in play
    variant: str = "plain"  # plain | frozen | mostly_frozen | unused | deep (6 blocks) | the VariantGPT ones below
    bucket: int = 4096  # small buckets: several per group, so ordering and padding are exercised
    lr: float = 2e-3
    weight_decay: float = 0.1
    clip: float = 1.0
    seq: int = 16
    persistence: int = 0  # stage 3: stage3_param_persistence_threshold
    model_persistence: int = 2**63 - 1  # stage 3: stage3_model_persistence_threshold (DeepSpeed's sys.maxsize)
    reuse: int = 0  # stage 3: stage3_max_reuse_distance
    prefetch: int = 50_000  # stage 3: stage3_prefetch_bucket_size
    max_live: int = 10**9  # stage 3: stage3_max_live_parameters
    offload: str = "none"  # offload_optimizer.device
    offload_param: str = "none"  # offload_param.device (stage 3)
    sub_group: int = 10**9  # sub_group_size
    ratio: float = 1.0  # offload_optimizer.ratio (stage 3, < 1: partial offload)
    reduce_scatter: bool = True  # zero_optimization.reduce_scatter (stages 1-2; false: all-reduce each bucket)
    # "fp32" masters (mixed precision), or masters in the compute dtype ("bf16", "fp16") with "fp32" or "bf16"
    # optimizer state ([Note: bf16 master weights]; the reference then trains in that dtype throughout)
    master: str = "fp32"
    state: str = "fp32"

    @property
    def name(self) -> str:
        extra = f"-persist{self.persistence}-reuse{self.reuse}" if self.stage == 3 else ""
        extra += f"-cap{self.model_persistence}" if self.model_persistence != 2**63 - 1 else ""
        extra += f"-live{self.max_live}" if self.max_live != 10**9 else ""
        extra += f"-offload_{self.offload}" if self.offload != "none" else ""
        extra += f"-offload_param_{self.offload_param}" if self.offload_param != "none" else ""
        extra += f"-ratio{self.ratio}" if self.ratio != 1.0 else ""
        extra += f"-bucket{self.bucket}" if self.bucket != 4096 else ""
        extra += "-allreduce" if not self.reduce_scatter else ""
        extra += f"-master_{self.master}-state_{self.state}" if self.master != "fp32" else ""
        return f"stage{self.stage}-{self.dtype}-gas{self.gas}-{self.variant}{extra}"


class WithUnused(nn.Module):
    """A GPT plus a layer the forward never uses."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gpt = GPT(cfg)
        self.unused = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.config = cfg

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.gpt(idx, targets)


class VariantGPT(GPT):
    """Control flow stage 3 must survive: a block called twice (`twice`), blocks whose output is
    dropped (`unused_unit`), a block order that flips every other step (`order`, via `flip`), the tied
    embedding read as the head's weight in this forward, outside any module's (`outside`), or looked up outside the
    embedding module from the second step on, a path the first forward did not take (`outside_later`, with the
    root kept whole by config)."""

    def __init__(self, cfg: GPTConfig, variant: str):
        super().__init__(cfg)
        self.variant = variant
        self.flip = False
        if variant == "unused_unit":
            self.extras = nn.ModuleList(Block(cfg) for _ in range(2))
            self.extras.apply(self._init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.variant == "outside_later" and self.flip:  # the same lookup, outside the embedding module
            tokens = torch.nn.functional.embedding(idx, self.wte.weight)
        else:
            tokens = self.wte(idx)
        x = tokens + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        blocks = list(self.blocks)
        if self.variant == "twice":
            blocks = [blocks[0], *blocks]
        if self.variant == "order" and self.flip:
            blocks = blocks[::-1]
        if self.variant == "unused_unit":
            for extra in self.extras:
                extra(x)
        for block in blocks:
            x = block(x)
        if self.variant == "outside":
            logits = torch.nn.functional.linear(self.ln_f(x), self.wte.weight)
        else:
            logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def build_model(case: Case) -> nn.Module:
    torch.manual_seed(1234)
    model: nn.Module
    if case.variant in ("twice", "unused_unit", "order", "outside", "outside_later"):
        model = VariantGPT(TINY, case.variant)
    else:
        model = WithUnused(TINY) if case.variant == "unused" else GPT(DEEP if case.variant == "deep" else TINY)
    if case.variant == "frozen":
        model.wpe.weight.requires_grad_(False)
        for p in model.blocks[0].ln_1.parameters():
            p.requires_grad_(False)
    if case.variant == "mostly_frozen":  # LoRA-like: a block's big matrices frozen, 9% of it trains
        for name, p in model.named_parameters():
            if name.startswith("blocks.") and (".qkv." in name or ".mlp." in name):
                p.requires_grad_(False)
    return model


def param_groups(model: nn.Module, case: Case) -> list[dict]:
    """Two groups (decay on matrices, none on vectors), so group options must be preserved."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": case.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def global_batches(case: Case, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    size = case.micro * case.gas * world_size
    out = []
    for _ in range(case.steps):
        x = torch.randint(0, TINY.vocab_size, (size, case.seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def micro_batch(batch: tuple[torch.Tensor, torch.Tensor], k: int, rank: int, world_size: int, micro: int):
    """Micro-step k of `rank` takes rows [(k*world_size + rank)*micro, ... + micro) of the global batch."""
    start = (k * world_size + rank) * micro
    return batch[0][start : start + micro], batch[1][start : start + micro]


def ds_config(case: Case) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.gas,
        "gradient_clipping": case.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": case.lr, "weight_decay": case.weight_decay}},
        "bf16": {"enabled": case.dtype == "bf16"},
        "zero_optimization": {
            "stage": case.stage,
            "reduce_bucket_size": case.bucket,
            "allgather_bucket_size": case.bucket,
            "overlap_comm": True,
            "reduce_scatter": case.reduce_scatter,
            "stage3_param_persistence_threshold": case.persistence,
            "stage3_model_persistence_threshold": case.model_persistence,
            "stage3_max_reuse_distance": case.reuse,
            "stage3_prefetch_bucket_size": case.prefetch,
            "stage3_max_live_parameters": case.max_live,
            "offload_optimizer": {
                "device": case.offload,
                "pin_memory": True,
                "nvme_path": tempfile.gettempdir(),
                "ratio": case.ratio,
            },
            "sub_group_size": case.sub_group,
            "offload_param": {"device": case.offload_param, "pin_memory": True, "nvme_path": tempfile.gettempdir()},
        },
    }
    if case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": FP16_LOSS_SCALE}
    if case.master == "bf16":
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=case.state == "bf16")
    if case.master == "fp16":
        config["fp16"]["fp16_master_weights_and_grads"] = True
    if case.variant == "outside_later":  # [Note: root unit by module]: the probe cannot see a later path
        config["zeroshard"] = {"stage3_root_by_module": False}
    return config


def flat_params(model: nn.Module) -> torch.Tensor:
    """On the host: results cross process boundaries by value, and are compared there."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu()


def traced_reference(
    model: nn.Module,
    groups: list[dict],
    case: Case,
    replicas: int,
    eps: float,
    targets: Callable[[torch.Tensor, int], torch.Tensor] = lambda y, rank: y,
) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Per-step mean loss, gradient norm (before clipping) and parameters of plain PyTorch training `model` (AdamW
    with `eps`) on the global batches of `replicas` replicas; `targets(y, replica)` may change a micro-batch's."""
    optimizer = torch.optim.AdamW(groups, lr=case.lr, eps=eps)
    losses, norms, params = [], [], []
    n_micro = replicas * case.gas
    for batch in global_batches(case, replicas):
        model.zero_grad()
        step_loss = 0.0
        for k in range(case.gas):
            for r in range(replicas):
                x, y = micro_batch(batch, k, r, replicas, case.micro)
                loss = model(x, targets(y, r))
                step_loss += loss.item() / n_micro
                (loss / n_micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)))
        optimizer.step()
        losses.append(step_loss)
        params.append(flat_params(model))
    return losses, norms, params


@contextlib.contextmanager
def ranks_threads() -> Iterator[None]:
    """Compute as the ranks do, on one thread (helpers/harness.py): on a CPU with AVX512-BF16, oneDNN's bf16 kernels
    split their sums by the thread count, so a reference on two threads rounds a gradient's last bit differently from a
    rank on one (measured: one bf16 master element a step apart, then drift, where fp32 state is otherwise exact)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_run(
    case: Case,
    world_size: int,
    device: torch.device | str = "cpu",
    values: dict[str, torch.Tensor] | None = None,
    optimizer_for: Callable[[nn.Module, Case], torch.optim.Optimizer] | None = None,
) -> tuple[list[float], list[torch.Tensor]]:
    """Per-step mean loss and per-step flat parameters of the single-process reference (on `device`: the GPU suite
    compares a CUDA engine with a CUDA reference); `values` replace the named parameters' initial values;
    `optimizer_for(model, case)` builds another optimizer than AdamW over `param_groups`."""
    if case.master != "fp32":
        assert values is None
        with ranks_threads():
            return _low_precision_reference(case, world_size, device)
    master_model = build_model(case).to(device)
    with torch.no_grad():
        for name, p in master_model.named_parameters():
            if values is not None and name in values:
                p.copy_(values[name])
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    work = copy.deepcopy(master_model).to(dtype)
    if optimizer_for is None:
        optimizer = torch.optim.AdamW(param_groups(master_model, case), lr=case.lr)
    else:
        optimizer = optimizer_for(master_model, case)
    trainable = [(m, w) for m, w in zip(master_model.parameters(), work.parameters(), strict=True) if m.requires_grad]
    losses, params = [], []
    n_micro = world_size * case.gas
    for step, batch in enumerate(global_batches(case, world_size)):
        work.flip = step % 2 == 1
        step_losses = []
        for m, _ in trainable:
            m.grad = torch.zeros_like(m)
        for k in range(case.gas):
            for r in range(world_size):
                x, y = (t.to(device) for t in micro_batch(batch, k, r, world_size, case.micro))
                loss = work(x, y)
                step_losses.append(loss.item())
                (loss / n_micro).backward()
                for m, w in trainable:
                    if w.grad is not None:
                        m.grad += w.grad.float()
                        w.grad = None
        torch.nn.utils.clip_grad_norm_([m for m, _ in trainable], case.clip)
        optimizer.step()
        with torch.no_grad():
            for m, w in zip(master_model.parameters(), work.parameters(), strict=True):
                w.copy_(m)
        losses.append(sum(step_losses) / len(step_losses))
        params.append(flat_params(work))
    return losses, params


def _low_precision_reference(
    case: Case, world_size: int, device: torch.device | str
) -> tuple[list[float], list[torch.Tensor]]:
    """Masters in the compute dtype: the model trains in bf16 (or fp16) throughout (gradients accumulated in that
    dtype), and AdamW (fused: fp32 arithmetic, one rounding) steps the weights directly (bf16 state) or fp32 copies
    of them, rounded back after each step, whose fp32 state persists. The clipping norm is computed in fp32 from the
    low-precision gradients. fp16 scales the loss by FP16_LOSS_SCALE; the gradients summed over micro-batches are
    scaled to their mean (unscaled, clipped) in one multiplication, as the engine does (halving first would round fp16
    subnormals differently)."""
    dtype = torch.float16 if case.master == "fp16" else torch.bfloat16
    loss_scale = FP16_LOSS_SCALE if case.master == "fp16" else 1.0
    model = build_model(case).to(device).to(dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    shadows = {p: p.detach().float().requires_grad_() for p in trainable} if case.state == "fp32" else {}
    stepped = [shadows.get(p, p) for p in model.parameters()]
    groups = [{**g, "params": [stepped[i] for i in g["params"]]} for g in _group_indices(model, case)]
    optimizer = torch.optim.AdamW(groups, lr=case.lr, fused=True)
    losses, params = [], []
    n_micro = world_size * case.gas
    for step, batch in enumerate(global_batches(case, world_size)):
        model.flip = step % 2 == 1
        step_losses = []
        for p in trainable:
            p.grad = torch.zeros_like(p)
        for k in range(case.gas):
            for r in range(world_size):
                x, y = (t.to(device) for t in micro_batch(batch, k, r, world_size, case.micro))
                kept = {p: p.grad for p in trainable}
                for p in trainable:
                    p.grad = None
                loss = model(x, y)
                step_losses.append(loss.item())
                (loss * loss_scale).backward()  # the engine's: one rank's micro-batch, loss-scaled
                for p in trainable:
                    if p.grad is not None:
                        kept[p] += p.grad
                    p.grad = kept[p]
        scale = 1.0 / (loss_scale * n_micro)  # the sum over micro-batches becomes their mean here, as in the engine
        if case.clip > 0:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in trainable]))
            coef = case.clip / (float(norm) * scale + 1e-6)
            scale *= min(coef, 1.0)
        if scale != 1.0:
            for p in trainable:
                p.grad.mul_(scale)
        with torch.no_grad():
            for p, shadow in shadows.items():
                shadow.copy_(p)
                shadow.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, shadow in shadows.items():
                p.copy_(shadow)
        losses.append(sum(step_losses) / len(step_losses))
        params.append(flat_params(model))
    return losses, params


def _group_indices(model: nn.Module, case: Case) -> list[dict]:
    """`param_groups(model, case)` with each parameter given by its index in `model.parameters()`."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [{**g, "params": [index[id(p)] for p in g["params"]]} for g in param_groups(model, case)]


def engine_run(
    rank: int,
    world_size: int,
    case: Case,
    configure: Callable[[dict], dict] | None = None,
    prepare: Callable[[Any], None] | None = None,
    build: Callable[[Case], nn.Module] = build_model,
):
    """Train `case` with zeroshard on this rank; per-step mean local loss and per-step flat params. `prepare` gets
    the engine before the first step (`engine.compile()`, say); `build` makes the model (module-level: it is sent
    to the ranks)."""
    import zeroshard

    model = build(case)
    config = ds_config(case) if configure is None else configure(ds_config(case))
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    if prepare is not None:
        prepare(engine)
    losses, params = [], []
    for step, batch in enumerate(global_batches(case, world_size)):
        engine.module.flip = step % 2 == 1
        step_losses = []
        if case.variant == "eval":  # an evaluation forward between steps must not disturb training
            with torch.no_grad():
                engine(*(t.to(engine.device) for t in micro_batch(batch, 0, rank, world_size, case.micro)))
        for k in range(case.gas):
            x, y = (t.to(engine.device) for t in micro_batch(batch, k, rank, world_size, case.micro))
            loss = engine(x, y)
            step_losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        losses.append(sum(step_losses) / len(step_losses))
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    report = engine.memory_report()
    engine.destroy()
    return losses, params, report


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def save_and_resume(
    rank: int, world_size: int, directory: str, saver: Case, loader: Case, config: Callable[[Case], dict]
) -> list[list[torch.Tensor]]:
    """`saver` saves after two steps and trains two more; `loader` (another stage and layout) loads the save and
    trains the same two: [the saver's last two parameter vectors, the loader's]. The optimizer state must come back
    into the other layout for them to agree."""
    import zeroshard

    batches = global_batches(saver, world_size)
    runs = []
    for case, load in ((saver, False), (loader, True)):
        model = build_model(case)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config(case))
        if load:
            engine.load_checkpoint(directory)
        values = []
        for step, batch in enumerate(batches):
            if load and step < 2:
                continue
            engine.backward(engine(*micro_batch(batch, 0, rank, world_size, case.micro)))
            engine.step()
            if step == 1 and not load:
                engine.save_checkpoint(directory)
            with zeroshard.GatheredParameters(list(engine.module.parameters())):
                values.append(flat_params(engine.module))
        runs.append(values[-2:])
        engine.destroy()
    return runs
