"""`hybrid_engine` on CUDA ([Note: hybrid engine] in hybrid_engine.py): generation with the model gathered once per
call gives the tokens the same model gives on the same GPU; `release_inference_cache` hands the memory generation
cached back to the device (the caching allocator's reserved bytes fall back), and without it they stay reserved."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import tiny_llama

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


def _generate(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    out: dict[str, Any] = {}
    # a 32k vocabulary: the logits of a call (16 x 16 x 32000 in bf16, 16 MB at the prompt) take large blocks
    prompts = torch.randint(0, 32000, (16, 16), generator=torch.Generator().manual_seed(rank))
    for release in (False, True):
        config = {
            "train_micro_batch_size_per_gpu": 16,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, "release_inference_cache": release},
        }
        model = tiny_llama(vocab=32000)  # seeds every generator itself: draw the per-rank seed after it
        torch.cuda.manual_seed(100 + rank)
        engine, *_ = zeroshard.initialize(model=model, config=config)
        out[f"draw_{release}"] = torch.rand(4, device="cuda").cpu()  # rank 0's CUDA RNG state since initialize
        weights = {k: v.clone() for k, v in engine.module_state_dict().items()}
        ids = prompts.to(engine.device)
        engine.eval()
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # this thread's cuBLAS workspace (32 MiB)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what generation leaves reserved is then its own blocks, not older ones
        before = torch.cuda.memory_reserved()
        seq = engine.module.generate(input_ids=ids, max_new_tokens=8, do_sample=False, synced_gpus=True)
        torch.cuda.synchronize()
        out[f"reserved_{release}"] = (before, torch.cuda.memory_reserved())
        out[f"seq_{release}"] = seq.cpu()
        reference = tiny_llama(vocab=32000).to(device=engine.device, dtype=torch.bfloat16)
        reference.load_state_dict(weights)
        out[f"reference_{release}"] = reference.eval().generate(input_ids=ids, max_new_tokens=8, do_sample=False).cpu()
        engine.destroy()
        del reference
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hybrid_generation_and_its_cache_on_cuda(world_size: int) -> None:
    results = run_on_ranks(_generate, world_size)
    for out in results:
        for release in (False, True):
            assert torch.equal(out[f"seq_{release}"], out[f"reference_{release}"]), release
        kept_before, kept_after = out["reserved_False"]
        released_before, released_after = out["reserved_True"]
        assert kept_after > kept_before, out["reserved_False"]  # the key-value cache's blocks stay cached
        assert released_after <= released_before, out["reserved_True"]
    if world_size > 1:  # rank 0's CUDA RNG state everywhere since initialize, though each rank seeded its own
        for release in (False, True):
            assert all(torch.equal(out[f"draw_{release}"], results[0][f"draw_{release}"]) for out in results)
