"""Ulysses for Hugging Face models (DeepSpeed's ALST entry points, [Note: Ulysses for Hugging Face models]): the
script of DeepSpeed's own test (tests/unit/ulysses_alst/test_ulysses_sp_hf.py) on a tiny Llama built from a config,
2 gloo ranks, run with DeepSpeed 0.19.8 and with zeroshard, only the import swapped: the adapter's batches, the
loss (the ranks' parts aggregated as Hugging Face's Trainer does) equal to the single-process loss on the whole
sequence, and the same losses, gradient norms and parameters over 3 steps as DeepSpeed's."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks

pytest.importorskip("transformers")

SEQ = 8
KV_HEADS = [2, 1]  # GQA with the heads split evenly, and one key/value head replicated over the 2 ranks


def _model(kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _samples() -> Any:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (4, SEQ), generator=gen)
    return torch.utils.data.TensorDataset(ids, torch.arange(SEQ).expand(4, SEQ))


def _collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids, positions = batch[0]
    return {"input_ids": ids[None], "position_ids": positions[None], "labels": ids[None]}


def _reference(kv_heads: int) -> tuple[float, float]:
    """The first sample's loss and gradient norm on one process, whole sequence."""
    model = _model(kv_heads)
    batch = next(iter(torch.utils.data.DataLoader(_samples(), batch_size=1, collate_fn=_collate)))
    loss = model(**batch).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return float(loss.detach()), float(norm)


def _script(deepspeed: Any, kv_heads: int) -> dict[str, Any]:
    """DeepSpeed's ALST recipe; `deepspeed` is DeepSpeed or zeroshard."""
    import importlib

    import torch.distributed as dist

    ulysses = importlib.import_module(f"{deepspeed.__name__}.runtime.sequence_parallel.ulysses_sp")
    model = _model(kv_heads)
    mpu = ulysses.UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=2,
        micro_batch_size=1,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    loader = torch.utils.data.DataLoader(_samples(), batch_size=1, collate_fn=_collate)
    adapter = ulysses.UlyssesSPDataLoaderAdapter(
        loader,
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=group,
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=torch.device("cpu"),
    )
    batches, losses, norms = [], [], []
    for _ in range(3):
        batch = next(adapter)
        batches.append({k: v.tolist() for k, v in batch.items()})
        shift_labels = batch["shift_labels"]
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = engine.module.loss_function(
            logits=logits, labels=None, shift_labels=shift_labels, vocab_size=engine.module.config.vocab_size
        )
        # Hugging Face's Trainer: the parts' losses weighted by their tokens, differentiably
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=group)
        good = (shift_labels != -100).sum()
        good_per_rank = torch.distributed.nn.functional.all_gather(good, group=group)
        total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(2)) / sum(good_per_rank)
        engine.backward(total)
        engine.step()
        losses.append(float(total))
        norms.append(float(engine.get_global_grad_norm()))
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    mpu._release_sequence_parallel_groups()
    dist.barrier()
    return {"batches": batches, "losses": losses, "norms": norms, "params": params}


def _both(rank: int, world_size: int) -> list[dict[str, Any]]:
    deepspeed = import_deepspeed()
    import_deepspeed("deepspeed.runtime.sequence_parallel.ulysses_sp")
    import transformers.modeling_utils as hf

    import zeroshard

    deepspeed.init_distributed(dist_backend="gloo")
    sdpa = hf.ALL_ATTENTION_FUNCTIONS["sdpa"]
    out = []
    for kv_heads in KV_HEADS:  # each registration wraps the implementation it finds: restore the original
        ds = _script(deepspeed, kv_heads)
        hf.ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        ours = _script(zeroshard, kv_heads)
        hf.ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        out.append({"ds": ds, "ours": ours})
    return out


def test_hf_ulysses_matches_deepspeed_with_the_import_swapped() -> None:
    per_rank = run_on_ranks(_both, 2, timeout=600)
    for i, kv_heads in enumerate(KV_HEADS):
        _check(kv_heads, [runs[i] for runs in per_rank])


def _check(kv_heads: int, runs: list[dict[str, Any]]) -> None:
    ref_loss, ref_norm = _reference(kv_heads)
    for rank, run in enumerate(runs):
        ds, ours = run["ds"], run["ours"]
        assert ours["batches"] == ds["batches"], rank
        # the first batch is the first sample, split: the same loss as on one process
        assert abs(ours["losses"][0] - ref_loss) <= 1e-6 * ref_loss, (ours["losses"][0], ref_loss)
        for a, b in zip(ours["losses"], ds["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, ours["losses"], ds["losses"])
        for a, b in zip(ours["norms"], ds["norms"], strict=True):
            assert abs(a - b) <= 1e-5 * b, (rank, ours["norms"], ds["norms"])
        diff = float((ours["params"] - ds["params"]).abs().max() / ds["params"].abs().max())
        assert diff <= 1e-6, (rank, diff)
    # The Trainer's aggregation makes every rank's loss the whole sequence's, and the all-gather's backward sums
    # the ranks' uses, while the engine (DeepSpeed's too) sums a sample's ranks' gradients: the gradient is P times
    # the single-process one, in DeepSpeed and here alike (README, sequence parallelism)
    ratio = runs[0]["ours"]["norms"][0] / ref_norm
    assert abs(ratio - 2.0) <= 1e-5, (kv_heads, ratio)


def _hub_kernel(rank: int, world_size: int) -> list[Any]:
    """A Hub kernel's name (`org/repo`) as the attention implementation: registered through transformers' lazy
    loader before it is looked up (DeepSpeed's test_register_hub_kernel_attn, the loader mocked: no hub here)."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import zeroshard
    from zeroshard.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

    zeroshard.init_distributed()
    name, called = "kernels-community/flash-attn2", []

    def lazy_import(implementation: str, attention_wrapper: Any = None, allow_all_kernels: bool = False) -> Any:
        called.append(implementation)
        if implementation not in ALL_ATTENTION_FUNCTIONS:
            ALL_ATTENTION_FUNCTIONS.register(implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])
        return (None, None, None, None), None

    original = fa.lazy_import_flash_attention
    fa.lazy_import_flash_attention = lazy_import
    folder = tempfile.mkdtemp()  # a model named by its path, as DeepSpeed's test names one on the hub
    _model(2).config.save_pretrained(folder)
    try:
        mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=folder, core_attn_implementation=name, sequence_parallel_size=2, micro_batch_size=1
        )
        wrapped = getattr(ALL_ATTENTION_FUNCTIONS[name], "ulysses_wraps", None) is not None
        parallel_state_sp._release_sequence_parallel_groups()
    finally:
        fa.lazy_import_flash_attention = original
        shutil.rmtree(folder)
    return [called, wrapped, mpu is not None]


def test_a_hub_kernel_attention_is_registered_before_it_is_looked_up() -> None:
    for out in run_on_ranks(_hub_kernel, 2):
        assert out == [["kernels-community/flash-attn2"], True, True]
