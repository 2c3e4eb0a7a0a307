"""AutoTP beyond Llama's plan, on 2 gloo ranks (tp2 x dp1), each against the single-process reference (fp32,
per-step losses and gradient norms to 1e-5 relative, clipping active, ZeRO stage 1): Qwen3 by its Hugging Face plan
(q_norm/k_norm "replicated_with_grad_allreduce": replicated DTensors whose gradients are summed over tp, [Note:
replicated with grad all-reduce]; their trained values equal the reference's), Phi-3 by its plan (fused qkv_proj and
gate_up_proj "colwise_gather_output", o_proj/down_proj "rowwise_split_input"), and Llama by DeepSpeed's
`partition_config` ([Note: autotp layer specs]: layer 1's MLP left whole, lm_head split with its logits gathered).
Slow: DeepSpeed's "llama" `preset_model`, Qwen3 and the fused Phi-3 on the fsdp2 backend at stage 3, GPT-NeoX
by its plan ("embedding_rowwise"), checkpoints resumed and resharded, whole state dicts of fused layers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.tp_parity import TpCase, engine_losses, trained_reference

CASES = [
    TpCase(stage=1, steps=2, arch="qwen3"),
    TpCase(stage=1, steps=2, arch="phi3"),
    TpCase(stage=1, steps=2, specs="custom"),
    TpCase(stage=1, steps=2, arch="phi3", specs="fused"),
]
SLOW_CASES = [
    TpCase(stage=2, steps=2, specs="preset"),
    TpCase(stage=3, steps=2, arch="qwen3", backend="fsdp2"),
    TpCase(stage=3, steps=2, arch="phi3", specs="fused", backend="fsdp2"),
    TpCase(stage=2, steps=2, arch="gpt_neox"),
    TpCase(stage=0, steps=2, arch="qwen3", left_out=True),  # a q_norm left out of the optimizer is still clipped over
]

# what each case splits how (the tensor-parallel placement of layer 0 and 1's tensors, by name suffix)
PLACEMENTS: dict[str, dict[str, str]] = {
    "qwen3": {
        "layers.0.self_attn.q_norm.weight": "Replicate()",
        "layers.0.self_attn.q_proj.weight": "Shard(dim=0)",
    },
    "phi3": {
        "layers.0.self_attn.qkv_proj.weight": "Shard(dim=0)",
        "layers.1.mlp.down_proj.weight": "Shard(dim=1)",
    },
    "custom": {"layers.0.mlp.down_proj.weight": "Shard(dim=1)", "lm_head.weight": "Shard(dim=0)"},
    "preset": {
        "layers.1.mlp.down_proj.weight": "Shard(dim=1)",
        "layers.1.self_attn.k_proj.weight": "Shard(dim=0)",
    },
    "gpt_neox": {
        "gpt_neox.embed_in.weight": "Shard(dim=0)",  # "embedding_rowwise": vocab-parallel
        "layers.1.attention.query_key_value.weight": "Shard(dim=0)",
        "layers.1.attention.dense.weight": "Shard(dim=1)",
    },
    "fused": {
        "layers.0.self_attn.qkv_proj.weight": "_StridedShard(dim=0, sf=4)",
        "layers.1.mlp.gate_up_proj.weight": "_StridedShard(dim=0, sf=2)",
        "layers.1.mlp.down_proj.weight": "Shard(dim=1)",
    },
}
WHOLE: dict[str, tuple[str, ...]] = {  # left plain tensors (no DTensor) by the case's plan
    "custom": ("layers.1.mlp.down_proj.weight", "layers.1.mlp.up_proj.weight", "embed_tokens.weight"),
    "preset": ("lm_head.weight", "embed_tokens.weight"),
    "fused": ("self_attn.o_proj.weight", "lm_head.weight"),
}


def _cases(rank: int, world_size: int, cases: list[TpCase]) -> list[dict[str, Any]]:
    return [engine_losses(rank, case) for case in cases]


def _key(case: TpCase) -> str:
    return case.specs or case.arch


def _check(cases: list[TpCase]) -> None:
    outs = run_on_ranks(_cases, 2, cases, timeout=600)
    for i, case in enumerate(cases):
        ref_losses, ref_norms, ref_model = trained_reference(case, dp=1)
        ref_named = dict(ref_model.named_parameters())
        for rank in range(2):
            out = outs[rank][i]
            assert out["dp"] == 1
            want = [step[0] for step in ref_losses]
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["losses"], want, strict=True)), (
                case.name,
                out["losses"],
                want,
            )
            # the first step's norm to 1e-6 (the same weights: a part of it counted wrong shows), later ones to 1e-5
            tolerances = [1e-6] + [1e-5] * (len(ref_norms) - 1)
            pairs = zip(out["norms"], ref_norms, tolerances, strict=True)
            assert all(math.isclose(a, b, rel_tol=tol) for a, b, tol in pairs), (
                case.name,
                out["norms"],
                ref_norms,
            )
            placements = out["placements"]
            for suffix, placement in PLACEMENTS[_key(case)].items():
                assert any(n.endswith(suffix) and p == placement for n, p in placements.items()), (suffix, placements)
            for suffix in WHOLE.get(_key(case), ()) if case.backend == "zero" else ():  # (fsdp2: DTensors over dp)
                assert not any(n.endswith(suffix) for n in placements), (suffix, placements)
            for name, value in out["trained"].items():  # the norms summed over tp move as the reference's
                # (AdamW moves every element ~lr=1e-2 per step whatever its gradient: a gradient near zero that
                # rounds apart moves it apart by a fraction of that; a missing sum over tp moves it by a whole step)
                torch.testing.assert_close(value, ref_named[name].detach(), rtol=1e-4, atol=2e-4)
            if case.arch == "qwen3":
                assert sum("_norm" in name for name in out["trained"]) == 2


def test_autotp_styles_and_specs_match_the_reference() -> None:
    _check(CASES)


@pytest.mark.slow
def test_autotp_preset_and_fsdp2_match_the_reference() -> None:
    _check(SLOW_CASES)


RESUMED = [
    TpCase(stage=2, steps=3, arch=a, specs=s) for a, s in (("qwen3", ""), ("llama", "custom"), ("phi3", "fused"))
]


def _resumes(rank: int, world_size: int, save_dir: str) -> list[dict[str, Any]]:
    from helpers.tp_parity import resume

    cases = [
        TpCase(stage=2, steps=3, arch=a, specs=s) for a, s in (("qwen3", ""), ("llama", "custom"), ("phi3", "fused"))
    ]
    return [resume(rank, case, f"{save_dir}/{case.name}", save_at=1, other_tp=1) for case in cases]


@pytest.mark.slow
def test_autotp_qwen3_and_custom_specs_resume_and_reshard(tmp_path: Any) -> None:
    """A checkpoint of each resumes exactly at tp2 and loads into tp1 (the replicated q_norm/k_norm DTensors, the
    specs' whole and split layers, the fused layers' parts): the next loss equal within 1e-6; the offline export
    (eager, lazy, streamed to safetensors) gives the whole model, which takes that step equally."""
    from zeroshard.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
    )

    results = run_on_ranks(_resumes, 2, str(tmp_path), timeout=600)
    for result in results:
        for got in result:
            assert got["resumed"] == got["straight"][1:], got
            assert math.isclose(got["other_tp_loss"], got["resumed"][0], rel_tol=1e-6), got
    # the offline export joins each case's slices (the fused parts in order): the model it gives takes the step the
    # resumed engine took first, equally; the streamed safetensors and the lazy state dict hold the same tensors
    from safetensors.torch import load_file

    from helpers.tp_parity import batch, llama
    from zeroshard.utils.zero_to_fp32 import to_torch_tensor

    for case, got in zip(RESUMED, results[0], strict=True):
        folder = str(tmp_path / case.name)
        whole = get_fp32_state_dict_from_zero_checkpoint(folder, tag="mid")
        model = llama(seed=7, arch=case.arch)
        model.load_state_dict(whole)
        ids = batch(1, 0)
        assert math.isclose(model(input_ids=ids, labels=ids).loss.item(), got["resumed"][0], rel_tol=1e-6), case
        convert_zero_checkpoint_to_fp32_state_dict(folder, str(tmp_path / f"{case.name}-out"), tag="mid")
        streamed = load_file(str(tmp_path / f"{case.name}-out" / "model.safetensors"))
        lazy = to_torch_tensor(get_fp32_state_dict_from_zero_checkpoint(folder, tag="mid", lazy_mode=True))
        for name, value in whole.items():
            assert torch.equal(streamed.get(name, value), value) and torch.equal(lazy[name], value), name


def _save_fused(rank: int, world_size: int, folder: str, stage: int, backend: str) -> Any:
    import zeroshard
    from helpers.tp_parity import config, llama

    zeroshard.init_distributed()
    cfg = config(TpCase(stage=stage, backend=backend, arch="phi3", specs="fused"))
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zeroshard.initialize(model=llama(arch="phi3"), config=cfg)
    engine.save_16bit_model(folder, "model.safetensors")
    whole = engine._consolidated_16bit_state_dict()
    engine.destroy()
    return None if whole is None else {k: v.float() for k, v in whole.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "backend"), [(1, "zero"), (3, "fsdp2")])
def test_fused_parts_are_saved_whole_in_their_order(tmp_path: Any, stage: int, backend: str) -> None:
    """`save_16bit_model` and OpenRLHF's `_consolidated_16bit_state_dict` of the fused Phi-3 equal the unsplit model
    (each rank's pieces put back part by part, [Note: fused sub-parameters])."""
    from safetensors.torch import load_file

    from helpers.tp_parity import llama

    results = run_on_ranks(_save_fused, 2, str(tmp_path), stage, backend, timeout=300)
    want = llama(arch="phi3").state_dict()
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(want) and set(results[0]) == set(want) and results[1] is None
    assert [k for k, v in want.items() if not torch.equal(saved[k].float(), v.float())] == []
    assert [k for k, v in want.items() if not torch.equal(results[0][k], v.float())] == []


def _tp_model_init(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard
    from helpers.tp_parity import config, run
    from zeroshard.module_inject.layers import is_autotp_training_mode
    from zeroshard.tp.model_init import RECORDED

    zeroshard.init_distributed()
    both = dist.new_group([0, 1])
    out: dict[str, Any] = {}

    def attempt(name: str, tp_config: dict[str, Any] | None, **kwargs: Any) -> Any:
        from helpers.tp_parity import llama

        RECORDED.args = None  # (process-wide, as DeepSpeed's record)
        mpu = kwargs.pop("mpu", None)
        model = zeroshard.tp_model_init(llama(), tp_size=2, dtype=kwargs.pop("dtype", torch.float32), **kwargs)
        cfg = config(TpCase(stage=1, steps=2))
        cfg.pop("tensor_parallel")
        cfg.update(tp_config or {})
        try:
            engine, *_ = zeroshard.initialize(model=model, config=cfg, mpu=mpu)
        except zeroshard.ConfigError as err:
            out[name] = str(err)
            return None
        return engine

    engine = attempt("split", None, tp_group=both)
    out["mode"] = is_autotp_training_mode()
    out["losses"] = run(engine, 0, range(2))[0]
    out["q_local"] = list(engine.module.model.layers[0].self_attn.q_proj.weight.to_local().shape)
    engine.destroy()
    attempt("conflict", {"tensor_parallel": {"autotp_size": 1}})
    attempt("dtype", {"bf16": {"enabled": True}})
    attempt("with_mpu", None, tp_group=both, mpu=object())
    attempt("one_rank_group", None, tp_group=dist.new_group([0]) if rank == 0 else dist.new_group([1]))
    RECORDED.args = None
    zeroshard.tp_model_init(nn_model := torch.nn.Linear(2, 2), tp_size=2, dtype=None)
    try:
        zeroshard.tp_model_init(nn_model, tp_size=4, dtype=None)
    except zeroshard.ConfigError as err:
        out["second_call"] = str(err)
    RECORDED.args = None
    return out


def test_tp_model_init_is_merged_into_the_config_at_initialize() -> None:
    """[Note: tp_model_init]: DeepSpeed's `tp_model_init(model, tp_size, dtype, tp_group)` before `initialize`
    fills autotp_size in (the model trains as the reference, split in two); conflicts are one line each."""
    case = TpCase(stage=1, steps=2)
    want = [step[0] for step in trained_reference(case, dp=1)[0]]
    for out in run_on_ranks(_tp_model_init, 2, timeout=300):
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["losses"], want, strict=True)), out
        assert out["q_local"] == [32, 64] and out["mode"] is True
        assert "tensor_parallel.autotp_size=1 conflicts with tp_model_init(tp_size=2)" in out["conflict"]
        assert "trains in torch.bfloat16 but tp_model_init(tp_size=2) asked for dtype=torch.float32" in out["dtype"]
        assert "its tp_group has 1 ranks" in out["one_rank_group"]
        assert "was given tp_group; then initialize must not receive mpu=" in out["with_mpu"]
        assert "conflicts with an earlier call" in out["second_call"]
