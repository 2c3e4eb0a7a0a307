"""Tiled compute ([Note: tiled compute], DeepSpeed's ALST `TiledMLP`, `TiledFusedLogitsLoss`,
`sequence_tiled_compute`) under the engine: a GPT whose MLPs and loss are tiled, its embedding tied to lm_head,
trains on 2 ranks as the same model does on one process (same seed, same global batch): losses, gradient norms
and parameters every step, at stages 0-3, with CPU offload, gradient accumulation and the fsdp2 backend. The
weights' gradients arrive once per slice, in separate autograd passes: stages 0-2 take them when the last slice's
has arrived (`ds_grad_is_ready`), and the tied weight's share from the embedding arrives after its bucket was
reduced, so that bucket is reduced once more ([Note: gradients after their bucket's reduction]): one collective
more per backward than the untiled model's, where weights not held back cost one per slice."""

from __future__ import annotations

from typing import Any

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, ds_config, flat_params, global_batches, micro_batch, param_groups, traced_reference
from helpers.tiled import tiled_model

EPS = 1e-6  # as test_sequence_parallel: slices sum a weight's gradient in a different order than one product
CASES = [
    (Case(stage=0, steps=3), "listed", "fused", {}),
    (Case(stage=1, gas=2, steps=3), "default", "fused", {}),
    (Case(stage=2, steps=3), "listed", "generic", {}),
    (Case(stage=2, steps=3, offload="cpu"), "listed", "fused", {}),
    (Case(stage=3, gas=2, steps=3), "listed", "fused", {}),
    (Case(stage=2, steps=3), "listed", "fused", {"zeroshard": {"backend": "fsdp2"}}),
    # rank 0's last loss slice fully masked and skipping lm_head: the held-back sum still reaches the engine then,
    # as the other rank's does ([Note: tiled compute]); it hung when it stayed held on one rank
    (Case(stage=2, steps=3), "listed", "guarded", {}),
    (Case(stage=1, gas=2, steps=2), "listed", "guarded", {}),
    (Case(stage=2, steps=3), "none", "fused", {}),  # no weight held back: each slice's gradient arrives on its own
    (Case(stage=2, steps=3), "off", "plain", {}),  # untiled: the collectives to compare with
]
STAGE2, NOT_HELD, UNTILED = 2, 8, 9


def _targets(y: torch.Tensor, rank: int, loss_kind: str) -> torch.Tensor:
    """ "guarded": rank 0's last 11 targets masked, so its last slice (of 11, 11, 10 tokens) has none."""
    if loss_kind != "guarded" or rank != 0:
        return y
    y = y.clone()
    y[-1, 5:] = -100
    return y


def reference(case: Case, weights: str, loss_kind: str, world: int) -> tuple[list[float], list[float], list[Any]]:
    model = tiled_model(case, weights, loss_kind)
    targets = lambda y, r: _targets(y, r, loss_kind)  # noqa: E731
    return traced_reference(model, param_groups(model.gpt, case), case, world, EPS, targets)


def train(rank: int, world: int, case: Case, weights: str, loss_kind: str, extra: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard

    model = tiled_model(case, weights, loss_kind)
    config = {**ds_config(case), **extra}
    config["optimizer"]["params"]["eps"] = EPS
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model.gpt, case), config=config)
    losses, norms, params = [], [], []
    for batch in global_batches(case, world):
        step_loss = torch.zeros(())
        for k in range(case.gas):
            x, y = micro_batch(batch, k, rank, world, case.micro)
            loss = engine(x, _targets(y, rank, loss_kind))
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / (world * case.gas)
        dist.all_reduce(step_loss)
        losses.append(float(step_loss))
        norms.append(engine.get_global_grad_norm())
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    ready = all(getattr(p, "ds_grad_is_ready", True) for p in engine.module.parameters())
    stats = engine.comm_stats.snapshot()
    calls = stats["reduce_scatter"]["calls"] + stats["all_reduce"]["calls"]
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "ready": ready, "calls": calls}


def _all(rank: int, world: int) -> list[dict[str, Any]]:
    return [train(rank, world, *case) for case in CASES]


def test_tiled_model_trains_as_on_one_process() -> None:
    runs = run_on_ranks(_all, 2, timeout=600)
    for i, (case, weights, loss_kind, extra) in enumerate(CASES):
        ref_losses, ref_norms, ref_params = reference(case, weights, loss_kind, 2)
        label = (case.name, weights, loss_kind, extra)
        for run in runs[0][i], runs[1][i]:
            assert run["ready"], label  # every weight's flag restored after the last slice
            for step, (loss, ref) in enumerate(zip(run["losses"], ref_losses, strict=True)):
                assert abs(loss - ref) <= 1e-6 * abs(ref), (label, step, loss, ref)
            for step, (norm, ref) in enumerate(zip(run["norms"], ref_norms, strict=True)):
                assert abs(norm - ref) <= 1e-5 * ref, (label, step, norm, ref)
            for step, (p, ref_p) in enumerate(zip(run["params"], ref_params, strict=True)):
                diff = float((p - ref_p).abs().max() / ref_p.abs().max())
                assert diff <= 1e-6, (label, step, diff)
    calls = [runs[0][i]["calls"] for i in (STAGE2, NOT_HELD, UNTILED)]
    backwards = CASES[STAGE2][0].steps
    # the tied weight's bucket reduced once more per backward; without the flag, many more (a late slice's each)
    assert calls[0] == calls[2] + backwards and calls[1] > calls[0], calls
