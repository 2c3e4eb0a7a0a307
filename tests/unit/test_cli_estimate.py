"""`zeroshard estimate`: the ZeRO formulas, DeepSpeed's estimators, the --json schema, the decision tree."""

from __future__ import annotations

import json

import pytest

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.cli.estimate.activations import activation_bytes
from zeroshard.cli.estimate.formulas import OPTIONS, Cluster, Option, Precision, deepspeed_states, zeroshard_states
from zeroshard.cli.estimate.recommend import HEADROOM, recommend
from zeroshard.cli.estimate.rows import estimate_rows
from zeroshard.cli.estimate.shapes import from_model_arg, from_params
from zeroshard.cli.main import main
from zeroshard.config import parse_config, resolve_config

PSI = 1_000_000
BF16 = Precision(param_bytes=2, grad_bytes=4, optimizer_bytes=8)
FP32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8)


@pytest.mark.parametrize(
    ("stage", "n", "expected"),
    [
        (0, 4, 18 * PSI),  # docs/design.md: 2 + 4 + 12
        (1, 4, 2 * PSI + 16 * PSI // 4),  # one micro-step per window: no full accumulator, as stage 2
        (2, 4, 2 * PSI + 16 * PSI // 4),
        (3, 4, 16 * PSI // 4),  # 2 + 2 (bf16 gradient shard: nothing to accumulate) + 4 + 8, all sharded
        (2, 1, 18 * PSI),  # one rank: nothing to shard
    ],
)
def test_bf16_model_states_follow_the_design_table(stage, n, expected):
    assert zeroshard_states(PSI, Option(stage), BF16, n).total == expected


def test_stage1_with_accumulation_keeps_a_full_accumulator():
    # the gradient shard is the front of the full accumulator ([Note: stage 1's accumulator on demand])
    assert zeroshard_states(PSI, Option(1), BF16, 4, gradient_accumulation_steps=2).total == 6 * PSI + 12 * PSI // 4


def test_stage3_accumulates_gradients_in_fp32():
    assert zeroshard_states(PSI, Option(3), BF16, 4, gradient_accumulation_steps=2).total == 18 * PSI // 4


def test_fp32_master_weights_alias_the_parameters_where_both_have_the_same_extent():
    assert zeroshard_states(PSI, Option(0), FP32, 2).master_weights == 0
    assert zeroshard_states(PSI, Option(2), FP32, 2).master_weights == 4 * PSI // 2
    assert zeroshard_states(PSI, Option(3), FP32, 2).master_weights == 0
    assert zeroshard_states(PSI, Option(3), FP32, 2).total == 16 * PSI // 2


def test_offload_moves_optimizer_state_and_parameters_off_the_gpu():
    """As zeroshard holds them (tests/distributed/test_cli_estimate_memory.py measures it): the device keeps its
    gradient buffers, the host an fp32 copy of the shard beside the master weights and optimizer state; stage 3's
    shard leaves the device once copied, unless micro-steps accumulate into it."""
    states = zeroshard_states(PSI, Option(2, "cpu"), BF16, 4)
    assert states.gpu == 2 * PSI + 4 * PSI // 4 and states.cpu == (4 + 4 + 8) * PSI // 4
    states = zeroshard_states(PSI, Option(3, "cpu", "cpu"), BF16, 4)
    assert states.gpu == 0 and states.cpu == (2 + 4 + 4 + 8) * PSI // 4
    states = zeroshard_states(PSI, Option(3, "cpu"), BF16, 4)
    assert states.gpu == 2 * PSI // 4 and states.cpu == (4 + 4 + 8) * PSI // 4
    states = zeroshard_states(PSI, Option(3, "cpu"), BF16, 4, gradient_accumulation_steps=2)
    assert states.gpu == (2 + 4) * PSI // 4  # the fp32 accumulation shard stays until the boundary's copy
    states = zeroshard_states(PSI, Option(3, "nvme", "nvme"), BF16, 4)
    assert states.nvme == (2 + 2 + 12) * PSI // 4 and states.cpu == 0  # gradients go to NVMe as well


def test_deepspeed_formulas_match_its_estimators():
    # estimate_zero2_model_states_mem_needs(total_params=1e6, num_gpus_per_node=4, cpu_offload=False) etc.
    cluster = Cluster(gpus_per_node=4, nodes=2)
    assert deepspeed_states(PSI, 10, Option(2), cluster) == (int(PSI * 4 * 4 * 1.5), 2 * PSI + int(18 * PSI / 8))
    assert deepspeed_states(PSI, 10, Option(2, "cpu"), cluster) == (int(PSI * 32 * 1.5), 2 * PSI)
    assert deepspeed_states(PSI, 10, Option(3), cluster) == (int(10 * 4 * 4 * 1.5), 40 + int(18 * PSI / 8))
    assert deepspeed_states(PSI, 10, Option(3, "cpu"), cluster) == (int(PSI * 8 * 1.5), 40 + int(2 * PSI / 8))
    assert deepspeed_states(PSI, 10, Option(3, "cpu", "cpu"), cluster) == (int(PSI * 9 * 1.5), 40)
    assert deepspeed_states(PSI, 10, Option(1), cluster) is None


def test_deepspeed_estimators_agree():
    stage2 = import_deepspeed("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = import_deepspeed("deepspeed.runtime.zero.stage3")
    cluster = Cluster(gpus_per_node=8, nodes=2)
    for offload in (True, False):
        option = Option(2, "cpu" if offload else "none")
        ds = stage2.estimate_zero2_model_states_mem_needs(7 * PSI, 8, 2, cpu_offload=offload)
        assert deepspeed_states(7 * PSI, 0, option, cluster) == ds
    for option, flags in (
        (Option(3), (False, False)),
        (Option(3, "cpu"), (True, False)),
        (Option(3, "cpu", "cpu"), (True, True)),
    ):
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(7 * PSI, 12345, 8, 2, *flags, zero_init=True)
        assert deepspeed_states(7 * PSI, 12345, option, cluster) == (cpu, gpu)


def test_model_shapes_are_counted_exactly_on_the_meta_device():
    info = from_model_arg("llama-2-7b")
    assert info.params == 6_738_415_616  # the published count
    assert info.largest_layer == 32000 * 4096  # the embedding
    assert info.shape.gated_mlp and info.shape.kv_heads == 32
    assert from_model_arg("gpt2").params == 124_439_808  # tied embedding counted once


def test_params_only_assumes_a_llama_like_shape():
    info = from_params(7e9)
    assert info.params == 7_000_000_000 and 3840 <= info.shape.hidden <= 4352 and info.assumed


def test_decision_tree_of_seed_000():
    def pick(params: float, gpus: int, gpu_gib: float | None):
        model = from_params(params)
        cluster = Cluster(gpus_per_node=gpus)
        rows = estimate_rows(model, cluster, BF16, seq_len=2048, micro_batch=1)
        return recommend(model.params, rows, cluster, None if gpu_gib is None else int(gpu_gib * 2**30))

    assert pick(1e9, 1, 80).option == Option(0)
    assert pick(7e9, 8, 1000).option == Option(1)
    assert pick(7e9, 8, 64).option == Option(1)  # 2Ψ + 16Ψ/8 and activations: 39.8 GiB, within 80% of 64 GiB
    assert pick(7e9, 8, 48).tree_option == Option(1)  # over 80% of 48 GiB: the tree's stage 1 is not the pick
    big = pick(30e9, 8, 1000)  # plenty of GPU memory: overlap_comm
    assert big.option == Option(2, "cpu") and big.zero_optimization["overlap_comm"] is True
    assert big.tree_option is None and big.fits is True
    unknown = pick(30e9, 8, None)  # GPU memory unknown: the tree, with pin_memory for a tight GPU
    assert unknown.option == Option(2, "cpu") and unknown.fits is None
    assert unknown.zero_optimization["offload_optimizer"]["pin_memory"] is True
    assert unknown.zero_optimization["overlap_comm"] is False
    huge = pick(175e9, 8, 1000)
    assert huge.option == Option(3, "nvme", "nvme") and any("3D" in note for note in huge.notes)


def _levers(params: float, gpus: int, nodes: int, gpu_gib: float, micro_batch: int = 1, checkpointing: bool = False):
    model = from_params(params) if isinstance(params, float) else from_model_arg(params)
    cluster = Cluster(gpus_per_node=gpus, nodes=nodes)
    rows = estimate_rows(model, cluster, BF16, 2048, micro_batch, checkpointing)

    def acts(ckpt: bool, mb: int) -> int:
        return activation_bytes(model.shape, 2048, mb, BF16.param_bytes, ckpt)

    return recommend(model.params, rows, cluster, int(gpu_gib * 2**30), acts, checkpointing, micro_batch), rows


def test_recommendation_is_an_option_that_fits():
    """Issue 17: llama-2-70b on 2 x 8 GPUs of 80 GiB; the tree's stage 2 + CPU offload needs ~203 GiB per GPU."""
    rec, rows = _levers("llama-2-70b", 8, 2, 80)
    assert rec.fits is True and rec.tree_option == Option(2, "cpu")
    assert rec.gpu_bytes is not None and rec.gpu_bytes <= HEADROOM * 80 * 2**30
    # without parameter offload, checkpointing is the cheaper lever: stage 3 + CPU optimizer offload with it
    assert rec.option == Option(3, "cpu") and rec.checkpointing and rec.micro_batch == 1
    by_option = {row.option: row for row in rows}
    assert by_option[Option(3, "cpu")].gpu_bytes_per_rank > HEADROOM * 80 * 2**30  # not without checkpointing
    assert rec.zero_optimization["stage"] == 3 and rec.zero_optimization["offload_optimizer"]["device"] == "cpu"


def test_stage_3_optimizer_offload_is_refined_to_the_smallest_partial_ratio_that_fits():
    """[Note: partial offload]: llama-2-70b on 16 x 80 GiB fits with the whole optimizer offloaded (14.3 GiB per
    GPU) and with most of it on the GPU; the recommendation offloads the least (steps of 0.05) that fits."""
    rec, rows = _levers("llama-2-70b", 8, 2, 80)
    by_option = {row.option: row for row in rows}
    moved = by_option[Option(3)].states.gpu - by_option[Option(3, "cpu")].states.gpu
    ratio = rec.zero_optimization["offload_optimizer"]["ratio"]
    limit = HEADROOM * 80 * 2**30
    assert 0 < ratio < 1 and rec.gpu_bytes is not None and rec.gpu_bytes <= limit
    whole = rec.gpu_bytes - int((1 - ratio) * moved)  # the same levers with everything offloaded
    assert whole + int((1 - (ratio - 0.05)) * moved) > limit  # 0.05 less offload would not fit
    assert rec.zero_optimization["sub_group_size"] == 216_000_000  # about 20 sub-groups of a rank's 4.3B
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": rec.zero_optimization}
    resolve_config(parse_config(config), world_size=16)  # a config initialize accepts
    tight, _ = _levers("llama-2-70b", 8, 2, 20)  # room for under 0.05 of it on the GPU: all offloaded
    assert tight.option == Option(3, "cpu") and "ratio" not in tight.zero_optimization["offload_optimizer"]
    # the tree's choice did not fit: memory is tight, and the config does what the reasons say
    assert any("GPU memory tight" in reason and "pin_memory on" in reason for reason in tight.reasons)
    assert tight.zero_optimization["offload_optimizer"]["pin_memory"] is True
    assert tight.zero_optimization["overlap_comm"] is False
    small, _ = _levers("llama-2-7b", 8, 1, 24)  # under 10B no memory reason is given: a plan that fits overlaps
    assert small.fits and small.option.stage == 3 and small.zero_optimization["overlap_comm"] is True


def test_micro_batch_is_the_last_lever_and_nothing_fitting_is_said_plainly(capsys):
    rec, _ = _levers(7e9, 8, 1, 80, micro_batch=64)
    assert rec.fits and rec.micro_batch < 64 and rec.checkpointing  # checkpointing before a smaller micro-batch
    assert any("gradient_accumulation_steps" in note for note in rec.notes)
    rec, _ = _levers("llama-2-70b", 8, 2, 2)
    # the least GPU memory: everything offloaded (to the CPU, or equally to NVMe, whose row comes after it)
    assert rec.fits is False and rec.option == Option(3, "cpu", "cpu") and rec.micro_batch == 1
    assert any(reason.startswith("nothing fits") for reason in rec.reasons)
    assert main(["estimate", "--model", "llama-2-70b", "--gpus", "8", "--nodes", "2", "--gpu-memory", "2"]) == 0
    text = capsys.readouterr().out
    assert "NOTHING FITS in 2.0 GiB per GPU" in text and "ds_config (does not fit)" in text


def test_estimate_json_schema(capsys):
    assert main(["estimate", "--params", "7e9", "--gpus", "8", "--nodes", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(OPTIONS)
    for row in rows:
        assert {"stage", "offload_optimizer", "offload_param", "gpu_bytes_per_rank", "cpu_bytes_per_node"} <= set(row)
        assert isinstance(row["gpu_bytes_per_rank"], int) and row["gpu_bytes_per_rank"] > 0
    assert sum(row["recommended"] for row in rows) == 1
    by_option = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in rows}
    stage2 = by_option[(2, "none", "none")]
    psi, n = 7_000_000_000, 16
    assert stage2["model_states_bytes_per_rank"]["total"] == 2 * psi + 16 * psi // n
    assert stage2["deepspeed_gpu_bytes_per_rank"] == 2 * psi + int(18 * psi / n)
    # GPU bytes fall as more is sharded or offloaded
    gpu = [
        by_option[k]["gpu_bytes_per_rank"]
        for k in [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (3, "none", "none")]
    ]
    assert gpu == sorted(gpu, reverse=True)


def test_estimate_text_output_names_the_recommendation(capsys):
    assert main(["estimate", "--model", "tiny-llama", "--gpus", "2", "--seq-len", "128"]) == 0
    text = capsys.readouterr().out
    assert "107,200 parameters" in text and "recommended (seed-000 decision tree): stage 1" in text


def test_estimate_errors_are_one_line(capsys):
    assert main(["estimate", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err and "Traceback" not in err


def test_a_frozen_base_costs_its_weights_only():
    """LoRA: 1% of 100x PSI trains; the frozen rest is its bf16 weight, sharded at stage 3 ([Note: frozen parameters
    at stage 3]), as the engine's memory_report counts it (test_stage3's footprint test). Stage 3 splits a unit's
    trainable elements evenly too, so each rank holds the masters, gradients and state of PSI/N of them:
    benchmarks.lora_bf16 measures 4.5 MiB of fp32 masters per rank for 2.36M adapters on 2 ranks (4 bytes each), as
    DeepSpeed."""
    frozen = 99 * PSI
    for stage in range(4):
        full = zeroshard_states(PSI, Option(stage), BF16, 4)
        lora = zeroshard_states(PSI, Option(stage), BF16, 4, frozen=frozen)
        weights = 2 * frozen // (4 if stage == 3 else 1)
        assert lora.params == full.params + weights
        assert (lora.gradients, lora.master_weights, lora.optimizer_state) == (
            full.gradients,
            full.master_weights,
            full.optimizer_state,
        )
    assert zeroshard_states(2_360_000, Option(3), BF16, 2, frozen=123_840_000).master_weights == 4 * 2_360_000 // 2
    rows = estimate_rows(from_params(7e9), Cluster(gpus_per_node=2), BF16, 2048, 1, trainable=35_000_000)
    assert all(row.deepspeed is None for row in rows)  # DeepSpeed's estimators count every parameter as trainable


def test_estimate_trainable_as_a_fraction_and_refused_out_of_range(capsys):
    assert main(["estimate", "--params", "7e9", "--gpus", "2", "--gpu-memory", "24", "--trainable", "0.005"]) == 0
    assert "35,000,000 trainable (0.50%)" in capsys.readouterr().out
    assert main(["estimate", "--params", "7e9", "--trainable", "8e9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trainable 8e+09" in err


def test_bf16_master_weights_cost_two_bytes_and_alias_the_stage3_shard():
    """[Note: bf16 master weights]: bf16 gradients and masters; at stage 3 the compute shard is the master, so
    model states are 12 bytes per parameter / N with fp32 Adam state and 8 with bf16 state
    (tests/distributed/test_bf16_master.py measures the engine's bytes)."""
    fp32_state = Precision(param_bytes=2, grad_bytes=2, optimizer_bytes=8, master_bytes=2)
    bf16_state = Precision(param_bytes=2, grad_bytes=2, optimizer_bytes=4, master_bytes=2)
    assert zeroshard_states(PSI, Option(3), fp32_state, 4).total == 12 * PSI // 4
    assert zeroshard_states(PSI, Option(3), bf16_state, 4).total == 8 * PSI // 4
    assert zeroshard_states(PSI, Option(3), bf16_state, 4).master_weights == 0
    assert zeroshard_states(PSI, Option(2), bf16_state, 4).total == 2 * PSI + (2 + 2 + 4) * PSI // 4
    offloaded = zeroshard_states(PSI, Option(3, "cpu"), bf16_state, 4)  # separate bf16 master and host copy
    assert offloaded.gpu == 2 * PSI // 4 and offloaded.cpu == (2 + 2 + 4) * PSI // 4


def test_estimate_bf16_master_flags(capsys):
    args = ["estimate", "--params", "7e9", "--gpus", "2", "--gpu-memory", "24", "--json"]
    assert main([*args, "--bf16-master-weights", "--bf16-optimizer-states"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["stage"] > 0 for row in rows)  # DeepSpeed too: stages 1-3 only
    assert all(row["deepspeed_gpu_bytes_per_rank"] is None for row in rows)  # its estimators assume fp32 masters
    stage3 = next(r for r in rows if r["stage"] == 3 and r["offload_optimizer"] == "none")
    assert stage3["model_states_bytes_per_rank"]["total"] == 8 * 7_000_000_000 // 2
    assert main(["estimate", "--params", "7e9", "--dtype", "fp32", "--bf16-master-weights"]) == 2
    assert "--bf16-master-weights needs --dtype bf16" in capsys.readouterr().err
    assert main(["estimate", "--params", "7e9", "--bf16-optimizer-states"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_quantized_frozen_weights_cost_a_byte_and_a_scale_per_block_at_stage_3():
    """zero_quantized_nontrainable_weights: frozen weights at 1 + 4/256 bytes / N at stage 3; nothing changes below it
    (DeepSpeed ignores the key there) or for the trainable parameters."""
    psi, frozen, n = 1_024_000, 256_000_000, 4
    quantized = Precision(quantized_frozen=True)
    for option in OPTIONS:
        plain, packed = (zeroshard_states(psi, option, p, n, frozen=frozen) for p in (Precision(), quantized))
        if option.stage < 3:
            assert packed == plain, option
        else:  # a rank keeps its 1/N of the trainable elements, its 1/N of the frozen ones packed
            rest = frozen // n
            assert packed.params == 2 * psi // n + rest + 4 * rest // 256, option
            assert (packed.master_weights, packed.optimizer_state) == (plain.master_weights, plain.optimizer_state)


def test_estimate_quantized_frozen_flag(capsys):
    args = ["estimate", "--params", "7e9", "--gpus", "2", "--gpu-memory", "8", "--trainable", "0.005"]
    assert main([*args, "--quantized-frozen"]) == 0
    out = capsys.readouterr().out
    assert "held as int8 blocks" in out and '"zero_quantized_nontrainable_weights": true' in out  # stage 3 chosen
    assert main(["estimate", "--params", "7e9", "--quantized-frozen"]) == 2
    assert "--quantized-frozen needs --trainable" in capsys.readouterr().err


def test_estimate_muon_keeps_momentum_on_matrices_and_adam_moments_on_the_rest(capsys):
    """Muon's state is 4 bytes per matrix element and Adam's 8 on embeddings, head and vectors
    (tests/distributed/test_cli_estimate_memory.py measures the engine's bytes)."""
    import torch
    import transformers

    from zeroshard.cli.estimate.shapes import count_matrices
    from zeroshard.presets import model_preset

    info = from_model_arg("tiny-llama")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_preset("tiny-llama").hf_config(vocab_size=259))
    names = [n for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "lm_head" not in n]
    assert info.matrices == count_matrices(model) == sum(model.get_parameter(n).numel() for n in names)
    assert 0 < info.matrices < info.params

    args = ["estimate", "--model", "tiny-llama", "--gpus", "2", "--dtype", "fp32", "--json"]
    states = {}
    for optimizer in ("adamw", "muon"):
        assert main([*args, "--optimizer", optimizer]) == 0
        rows = json.loads(capsys.readouterr().out)
        states[optimizer] = next(r for r in rows if r["stage"] == 3 and r["offload_optimizer"] == "none")
    muon, adamw = (states[k]["model_states_bytes_per_rank"]["optimizer_state"] for k in ("muon", "adamw"))
    assert adamw == 8 * (info.params // 2)
    assert abs(muon - (4 * info.matrices + 8 * (info.params - info.matrices)) // 2) <= 8

    assert main(["estimate", "--model", "tiny-llama", "--optimizer", "muon"]) == 0
    assert "muon (momentum on the" in capsys.readouterr().out
    assert main(["estimate", "--params", "7e9", "--optimizer", "muon", "--bf16-master-weights"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--optimizer muon needs fp32 master weights" in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--params", "inf"), ("--params", "nan"), ("--gpu-memory", "0"), ("--bucket-size", "-1")]
)
def test_numbers_that_parse_as_floats_but_mean_nothing_are_refused(flag, value, capsys):
    """inf was an OverflowError traceback, nan a bare ValueError, 0 GiB silently 80, a negative bucket -4 B."""
    argv = ["estimate", "--params", "7e9", flag, value] if flag != "--params" else ["estimate", flag, value]
    assert main(argv) == 2
    assert f"{flag} " in capsys.readouterr().err
