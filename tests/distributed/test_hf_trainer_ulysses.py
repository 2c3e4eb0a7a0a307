"""Ulysses in the Hugging Face Trainer ([Note: the Trainer's sequence parallelism]): `zeroshard.hf.Trainer` with
`TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2, ...))` on 2 ranks trains a tiny Llama (ZeRO-2;
then a second Trainer in the same processes, ZeRO-3 with gradient accumulation 2), each sample's sequence split over
the two ranks, as plain PyTorch trains it on one process on the whole sequences (the
Trainer's AdamW, warm-up and linear decay, clipping at 1.0) with the gradient doubled: Hugging Face's sequence-
parallel loss (the parts' losses all-gathered differentiably) gives P times the single-process gradient, in
DeepSpeed and here alike. The logged losses and gradient norms match it every step. Beside it, the same script
under transformers + DeepSpeed 0.19.8 (accelerate's DeepSpeed plugin): the same first loss; and there each rank reads
the whole dataset, so the adapter's two gathered batches are one sample twice and every sample trains twice per
epoch (pinned: zeroshard shards the loader over the world, so they are two samples). That is an artifact of this
CPU machine, not DeepSpeed's behaviour on GPUs: accelerate's DeepSpeed mode counts one process where no accelerator
is present (`num_processes` 1 on 2 ranks, measured), so it does not shard the loader."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.hf_trainer import SEQ, Tokens, arguments, ds_config, loss_recorder, tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
STEPS = 4


class WithPositions(Tokens):
    """The Ulysses adapter needs position_ids in every batch (DeepSpeed's too)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "position_ids": torch.arange(SEQ)}


def _run(rank: int, tmp: str, framework: str, stage: int = 2, gas: int = 1) -> dict[str, Any]:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    kwargs = arguments(
        os.path.join(tmp, f"{framework}{stage}"),
        deepspeed=ds_config(stage),
        parallelism_config=ParallelismConfig(sp_size=2, sp_handler=handler),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=gas,
        max_steps=STEPS,
    )
    if framework == "zeroshard":
        from zeroshard.hf import Trainer as Base
        from zeroshard.hf import TrainingArguments

        args = TrainingArguments(**kwargs)
    else:
        import_deepspeed()
        import transformers
        from transformers import Trainer as Base  # type: ignore[assignment]

        kwargs.pop("use_cpu")  # accelerate's DeepSpeed plugin picks the device
        args = transformers.TrainingArguments(**kwargs)
    seen: list[list[int]] = []

    class Recording(Base):  # type: ignore[misc,valid-type]
        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
            seen.append(inputs["input_ids"][0].tolist())
            return super().compute_loss(model, inputs, *a, **k)

    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    record = loss_recorder()
    logged: list[float] = []

    class Norms(type(record)):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "grad_norm" in logs:
                logged.append(float(logs["grad_norm"]))

    Recording(model=model, args=args, train_dataset=WithPositions(8 * gas), callbacks=[record, Norms()]).train()
    return {"losses": list(record.losses), "norms": logged, "parts": seen}


def _both(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import transformers.modeling_utils as hf

    sdpa, out = hf.ALL_ATTENTION_FUNCTIONS["sdpa"], {}
    for framework in ("zeroshard", "deepspeed"):  # each registration wraps what it finds: restore the original
        out[framework] = _run(rank, tmp, framework)
        hf.ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    out["zeroshard-stage3-gas2"] = _run(rank, tmp, "zeroshard", stage=3, gas=2)
    return out


def _reference(sequences: list[list[int]], gas: int = 1) -> tuple[list[float], list[float]]:
    """Plain PyTorch on whole sequences, `gas` per step: the Trainer's AdamW (lr 1e-2, 1 warm-up step, linear decay
    over STEPS), clipping at 1.0 of the doubled gradient; the mean loss of each step's sequences."""
    from transformers import get_linear_schedule_with_warmup

    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, 1, STEPS)
    losses, norms = [], []
    for first in range(0, len(sequences), gas):
        step_loss = 0.0
        for ids in sequences[first : first + gas]:
            batch = torch.tensor([ids])
            loss = model(input_ids=batch, labels=batch, position_ids=torch.arange(SEQ)[None]).loss
            (2 * loss / gas).backward()
            step_loss += float(loss) / gas
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, norms


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by Ulysses: test_ulysses_hf.py,
# test_sequence_parallel.py
@pytest.mark.slow
def test_trainer_with_sequence_parallelism_trains_as_whole_sequences(tmp_path: Any) -> None:
    per_rank = run_on_ranks(_both, 2, str(tmp_path), timeout=900)
    for name, gas in (("zeroshard", 1), ("zeroshard-stage3-gas2", 2)):
        ours = [r[name] for r in per_rank]
        sequences = [a + b for a, b in zip(ours[0]["parts"], ours[1]["parts"], strict=True)]  # rank 0: first halves
        assert len(sequences) == STEPS * gas and len({tuple(s) for s in sequences}) == STEPS * gas  # each once
        ref_losses, ref_norms = _reference(sequences, gas)
        for run in ours:
            assert len(run["losses"]) == STEPS, (name, run["losses"])
            for step in range(STEPS):
                loss, norm = run["losses"][step], run["norms"][step]
                assert math.isclose(loss, ref_losses[step], rel_tol=1e-5), (name, step, run["losses"], ref_losses)
                assert math.isclose(norm, ref_norms[step], rel_tol=1e-4), (name, step, run["norms"], ref_norms)
    ours = [r["zeroshard"] for r in per_rank]
    theirs = [r["deepspeed"] for r in per_rank]
    assert math.isclose(theirs[0]["losses"][0], ours[0]["losses"][0], rel_tol=1e-6)
    for run in theirs:  # identical pairs, one sample twice: accelerate counts one process on a CPU machine
        parts = run["parts"]
        assert parts[0] == parts[1] and parts[2] == parts[3] and parts[0] != parts[2], parts
