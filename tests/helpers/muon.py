"""The single-process reference of the Muon tests ([Note: Muon on flat shards] in optim/muon.py): zeroshard's Muon
optimizer over the model's own parameters, grouped as initialize groups them."""

from __future__ import annotations

import copy

import torch

from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch, param_groups

PARAMS = {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}


def muon_config(case: Case, params: dict) -> dict:
    config = ds_config(case)
    config["optimizer"] = {"type": "Muon", "params": dict(params)}
    return config


def reference(
    case: Case, world_size: int, params: dict, device: torch.device | str = "cpu"
) -> tuple[list[float], list[torch.Tensor]]:
    """One process: the whole global batch, `clip_grad_norm_`, then zeroshard's Muon over the model's parameters,
    grouped as initialize groups them. bf16: the forward and backward in a bf16 copy, its gradients summed in fp32
    into the fp32 masters, as the engine keeps them."""
    from zeroshard.optim import muon

    model = build_model(case).to(device)
    work = copy.deepcopy(model).to(torch.bfloat16) if case.dtype == "bf16" else model
    halves = []
    for group in param_groups(model, case):
        options = {k: v for k, v in group.items() if k != "params"}
        names = {id(p): n for n, p in model.named_parameters()}
        for use in (True, False):
            half = [p for p in group["params"] if muon.uses_muon(names[id(p)], p.shape) is use]
            if half:
                halves.append({**muon.half_options(params, options, use), "params": half})
    for group in halves:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer = muon.Muon(halves)
    losses, values = [], []
    n_micro = world_size * case.gas
    for batch in global_batches(case, world_size):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        total = 0.0
        for k in range(case.gas):
            for r in range(world_size):
                x, y = (t.to(device) for t in micro_batch(batch, k, r, world_size, case.micro))
                loss = work(x, y)
                total += loss.item() / n_micro
                (loss / n_micro).backward()
                if work is not model:
                    for m, w in zip(model.parameters(), work.parameters(), strict=True):
                        m.grad += w.grad.float()
                        w.grad = None
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        if work is not model:
            with torch.no_grad():
                for m, w in zip(model.parameters(), work.parameters(), strict=True):
                    w.copy_(m)
        losses.append(total)
        values.append(flat_params(work))
    return losses, values
