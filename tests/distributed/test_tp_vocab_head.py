"""DeepSpeed's `tensor_parallel.vocab_parallel_lm_head` on 2 gloo ranks (tp2): the head's logits stay this rank's
vocabulary slice (local tensors), `model.loss_function` is the vocabulary-parallel causal-LM loss over the engine's
tensor-parallel collectives, and the per-step losses and gradient norms equal the single-process reference (fp32,
1e-5 relative) at ZeRO stage 1 and at stage 3 on the fsdp2 backend ([Note: vocabulary-parallel LM head])."""

from __future__ import annotations

import math
from typing import Any

from helpers.harness import run_on_ranks
from helpers.tp_parity import VOCAB, TpCase, batch, config, llama, reference, run

CASES = [TpCase(stage=1, steps=3), TpCase(stage=3, steps=2, backend="fsdp2")]


def _train(rank: int, world_size: int) -> list[dict[str, Any]]:
    import zeroshard
    from zeroshard.sequence.cross_entropy import VocabParallelCausalLMLoss
    from zeroshard.utils import groups

    out = []
    for case in CASES:
        model = llama()
        cfg = config(case)
        cfg["tensor_parallel"] = {"autotp_size": 2, "vocab_parallel_lm_head": True}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ids = batch(99, 0)
        logits = engine(input_ids=ids).logits
        before = engine.comm_stats.snapshot()["all_reduce"]["calls"]
        engine(input_ids=ids, labels=ids)  # the loss's max, sum and target-logit all-reduces, counted
        calls = engine.comm_stats.snapshot()["all_reduce"]["calls"] - before
        losses, norms = run(engine, 0, range(case.steps))
        out.append(
            {
                "losses": losses,
                "norms": norms,
                "logits": (type(logits).__name__, tuple(logits.shape)),
                "loss_fn": isinstance(model.loss_function, VocabParallelCausalLMLoss),
                "loss_all_reduces": calls,
                "groups.mpu": groups.mpu is groups,  # AutoTP's mpu is the groups module, as DeepSpeed sets it
            }
        )
        engine.destroy()
    return out


def test_a_vocabulary_parallel_head_trains_as_the_reference() -> None:
    results = run_on_ranks(_train, 2)
    for i, case in enumerate(CASES):
        ref_losses, ref_norms = reference(case, dp=1)
        for rank, per_case in enumerate(results):
            got = per_case[i]
            assert got["logits"] == ("Tensor", (2, 16, VOCAB // 2)), (case.name, rank, got["logits"])
            assert got["loss_fn"] and got["loss_all_reduces"] == 3 and got["groups.mpu"], (case.name, rank, got)
            for step, (a, b) in enumerate(zip(got["losses"], [r[0] for r in ref_losses], strict=True)):
                assert math.isclose(a, b, rel_tol=1e-5), (case.name, rank, step, a, b)
            for step, (a, b) in enumerate(zip(got["norms"], ref_norms, strict=True)):
                assert math.isclose(a, b, rel_tol=1e-5), (case.name, rank, step, a, b)
