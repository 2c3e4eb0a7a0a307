"""DeepSpeed scripts run with only the import swapped (issue 22 item 2).

Each program in `scripts/` is a trimmed re-creation of a public DeepSpeed script or unit test (its header names
the upstream file and commit) that picks its library from `COMPAT_LIB` and prints, on rank 0, one line
`COMPAT_RESULT {"losses": ...}`. Here each runs on 2 gloo ranks under `torch.distributed.run`:

- `test_zeroshard_matches_deepspeed` runs it with zeroshard and compares the losses with DeepSpeed 0.19.8's,
  recorded in `reference_losses.json` (fp32 to 1e-6 relative; bf16 runs to 1e-2, about two bf16 ulps).
- `test_reference_is_deepspeed` (slow) runs the same script with DeepSpeed and checks the recorded losses, so
  the reference cannot drift from what DeepSpeed does; `python tests/compat/test_scripts.py [case ...]` rewrites
  the file (the named cases only, when given).
- The pipeline script (`deepspeed.pipe.PipelineModule`, `engine.train_batch()`, issue 18) runs the same way; its
  losses are compared at `PIPE_RTOL` ([Note: pipeline compat tolerance]).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.script_ranks import script_on_ranks

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
REFERENCE = HERE / "reference_losses.json"
MARKER = "COMPAT_RESULT "
FP32_RTOL = 1e-6
BF16_RTOL = 1e-2


@dataclass(frozen=True)
class Case:
    """One script run: its arguments ({tmp} is a fresh directory) and the ds_config passed as --deepspeed_config."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    ds_config: dict[str, Any] | None = None
    rtol: float = FP32_RTOL
    slow: bool = False  # slow-marked in test_zeroshard_matches_deepspeed (CI budget)
    nproc: int = 2
    # the ds_config handed over as `accelerate launch --config_file` does (environment variables), not as a flag
    accelerate_config: dict[str, Any] | None = None
    env: tuple[tuple[str, str], ...] = ()
    # results of models built under `zero.Init`: zeroshard replays their initialisation with seeds of its own ([Note:
    # initialisation recorded under zero_init]), DeepSpeed runs it as the model built whole: other initial values.
    # Compared for their steps and finiteness only
    own_init: tuple[str, ...] = ()


BING_BERT_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "steps_per_print": 1000,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
    "gradient_clipping": 1.0,
}

ACCELERATE_SCRIPT = "accelerate_deepspeed_with_config_support.py"
ACCELERATE_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}
ACCELERATE_ZERO2 = {**ACCELERATE_AUTO, "zero_optimization": {"stage": 2}}
ACCELERATE_ZERO3 = {
    **ACCELERATE_AUTO,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}

CASES = [
    Case("cifar_fp32_stage0", "cifar10_deepspeed.py", ("--stage", "0", "--dtype", "fp32")),
    Case("cifar_fp32_stage3", "cifar10_deepspeed.py", ("--stage", "3", "--dtype", "fp32")),
    # slow: secondary variant of cifar_fp32_stage3 (bf16 under the swapped import: hello_deepspeed_bf16_zero1)
    Case("cifar_bf16_stage2", "cifar10_deepspeed.py", ("--stage", "2", "--dtype", "bf16"), rtol=BF16_RTOL, slow=True),
    Case(
        "hello_deepspeed_bf16_zero1_offload_resume",
        "train_bert_ds.py",
        ("--checkpoint_dir", "{tmp}/exp"),
        rtol=BF16_RTOL,
    ),
    # the GAN pattern: two backward passes before one step, the generator's loss flowing through D (issue 22
    # item 3; [Note: a second backward], [Note: gradients outside engine.backward])
    Case("gan_fp32_stage0", "gan_deepspeed_train.py", ds_config={"train_batch_size": 16, "steps_per_print": 10}),
    # The pooler is left out of the optimizer: DeepSpeed's fp32 stage 0 still counts its gradient in the clipping
    # norm ([Note: clipping over the whole module at stage 0]); without that the losses moved 2e-6 relative.
    Case(
        "bing_bert_fp32_resume",
        "bing_bert_deepspeed_train.py",
        ("--output_dir", "{tmp}/saved_models"),
        ds_config=BING_BERT_CONFIG,
    ),
    Case("unit_test_ds_initialize", "test_ds_initialize.py", own_init=("no_optim_stage3",)),
    # DeepSpeed-Chat reads ZeRO-3's ds_* parameter attributes to save and count ([Note: DeepSpeed's parameter
    # attributes]): without them zeroshard saved every released parameter empty and counted 0 parameters
    Case("dschat_zero3_sft", "dschat_zero3_sft.py", ("--output_dir", "{tmp}/out")),
    # GatheredParameters(modifier_rank=r) on zero.Init's parameters before initialize ([Note: GatheredParameters
    # before initialize]): DeepSpeed's test, Megatron's init in __init__, DeepSpeed-Chat's load (before: a meta read)
    Case("zero_init_gathered_update", "zero_init_gathered_update.py"),
    # ignore_unused_parameters=false: an unused parameter raises the AssertionError that names the option
    Case("unit_test_ignore_unused_parameters", "test_ignore_unused_parameters.py"),
    Case("unit_test_latest_checkpoint", "test_latest_checkpoint.py", ("{tmp}/checkpoints",)),
    # DeepSpeedExamples' OPSD: build_rollout/HybridEngineRollout on a ZeRO-3 hybrid-engine student (greedy, then
    # sampled with 2 samples per prompt, reseeded per step), a ZeRO-3 offloaded teacher, the streamed reverse KL;
    # compared too: response tokens, EOS rows, pad ids left out of the mask, checksums of the ids and masks
    Case("opsd_rollout", "opsd_rollout.py"),
    # deepspeed.utils.safe_get_*/safe_set_*/safe_update_full_grad_vectorized at stages 1-3, offloaded or not: the
    # values set read back exactly and train as DeepSpeed's ([Note: setting a gradient])
    Case(
        "unit_test_zero_tensor_fragment",
        "test_zero_tensor_fragment.py",
        own_init=tuple(
            f"get_stage3_{o}_{api}_frozen{f}" for o in ("none", "cpu") for api in ("full", "local") for f in "01"
        )
        + tuple(f"set_stage3_{o}_local_{d}" for o in ("none", "cpu") for d in ("float32", "bfloat16"))
        + ("update_stage3_none", "update_stage3_cpu"),
        # slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by
        # test_compat_engine::test_safe_get_full_matches_a_single_process_reference_at_every_stage and test_set_grad
        slow=True,
    ),
    # [Note: Accelerate's DeepSpeed path on zeroshard]: one process, since accelerate's DeepSpeed mode counts one
    # process on a machine without an accelerator (2 ranks: test_accelerate_script_on_two_ranks)
    Case(
        "accelerate_zero2_adamw",
        ACCELERATE_SCRIPT,
        ("--output_dir", "{tmp}/out"),
        nproc=1,
        accelerate_config=ACCELERATE_ZERO2,
    ),
    Case(
        "accelerate_zero3_dummy_optim",
        ACCELERATE_SCRIPT,
        ("--output_dir", "{tmp}/out"),
        nproc=1,
        accelerate_config=ACCELERATE_ZERO3,
        slow=True,  # secondary: the same run without DeepSpeed installed is test_accelerate_script_without_deepspeed
    ),
    # no ds_config file: `accelerate config`'s answers reach the plugin as variables (DeepSpeed maps the AdamW to its
    # DeepSpeedCPUAdam for the CPU offload; the exported weights differ from it in the last bit after load_state)
    Case(
        "accelerate_zero2_offload_launch_variables",
        ACCELERATE_SCRIPT,
        ("--output_dir", "{tmp}/out"),
        nproc=1,
        env=(
            ("ACCELERATE_USE_DEEPSPEED", "true"),
            ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
            ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu"),
            ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2"),
        ),
        slow=True,  # secondary: the variables only build the config the cases above give as a file
    ),
]
# [Note: pipeline compat tolerance]
# Measured by dumping parameters and gradients at every optimizer step on both stages under both libraries: the
# first step's gradients are bitwise DeepSpeed's, and so is the second step's loss. zeroshard's default AdamW is
# torch's fused CPU kernel, DeepSpeed 0.19.8's (torch_adam) the for-loop one: after the first step a few weights
# differ by 1 ulp (with "fused": false in the optimizer params they are bitwise equal, and so are the second
# step's gradients). The second update still differs from DeepSpeed's by up to 1e-4 absolute; a hand-run torch
# AdamW on the dumped gradients reproduces neither library's second step, so the dumps miss something: not
# explained yet. This convnet on random labels has
# many near-zero gradients, which Adam's early sign-like steps turn into +-lr moves, so steps 3-4 differ by 5e-5
# and 2e-4 relative (the script's data-parallel path, -p 0, stays within 1.1e-7). The pipeline's own arithmetic is
# checked at 1e-5 against a single-process reference in tests/distributed/test_pipeline.py.
PIPE_RTOL = 1e-3
PIPELINE = Case(
    "pipeline_2_stages",
    "pipeline_train.py",
    ds_config={
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
    },
    rtol=PIPE_RTOL,
)


def run_script(case: Case, lib: str, tmp: Path, accelerate_launch: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `case` on `case.nproc` local gloo ranks with COMPAT_LIB=`lib`: zeroshard's on ranks forked with torch
    and zeroshard imported (helpers/script_ranks.py), DeepSpeed's under torchrun; with `accelerate_launch`, by
    `zeroshard accelerate-launch` from an accelerate config file naming its ds_config."""
    tmp.mkdir(parents=True, exist_ok=True)
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    if case.ds_config is not None:
        config = tmp / "ds_config.json"
        config.write_text(json.dumps(case.ds_config))
        args += ["--deepspeed_config", str(config)]
    added = {"COMPAT_LIB": lib, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **dict(case.env)}
    if case.accelerate_config is not None:
        config = tmp / "ds_config.json"
        config.write_text(json.dumps(case.accelerate_config))
        if not accelerate_launch:
            added.update({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    if lib == "zeroshard" and not accelerate_launch:  # forked ranks (DeepSpeed's runs keep their own processes)
        return script_on_ranks(str(SCRIPTS / case.script), args, case.nproc, added, str(tmp))
    env = {**os.environ, **added}
    src = str(HERE.parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(case.nproc)]
    if accelerate_launch:  # what `accelerate config` writes for a DeepSpeed config file
        answers = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": str(tmp / "ds_config.json"), "zero3_init_flag": False},
            "num_machines": 1,
            "num_processes": case.nproc,
            "main_process_port": 0,  # a free one
            "use_cpu": False,
        }
        (tmp / "accelerate.yaml").write_text(json.dumps(answers))  # YAML reads JSON
        command = [sys.executable, "-m", "zeroshard.cli.main", "accelerate-launch", "--config_file"]
        command.append(str(tmp / "accelerate.yaml"))
    line = [*command, str(SCRIPTS / case.script), *args]
    done = subprocess.run(line, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    if lib == "deepspeed" and done.returncode != 0 and "SIGABRT" in done.stderr:
        # DeepSpeed 0.19.8's ranks on gloo now and then die of SIGABRT in its teardown, after the script printed its
        # result (5 of 13 runs once, right after a DeepSpeed reinstall; each passed when run again): once more
        done = subprocess.run(line, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return done


def losses_of(done: subprocess.CompletedProcess[str], what: str) -> Any:
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or len(lines) != 1:
        output = (done.stdout + done.stderr).splitlines()
        errors = [line for line in output if line.startswith("[rank") and "Error" in line]  # the ranks' own errors
        tail = "\n".join(output[-30:])
        raise AssertionError(f"{what} exited {done.returncode} with {len(lines)} result lines: {errors}\n{tail}")
    return json.loads(lines[0][len(MARKER) :])["losses"]


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """{"a": [1, [2, 3]]} -> {"a/0": 1, "a/1/0": 2, "a/1/1": 3}: every loss under a readable key."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}{key}/").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): float(value)}


def assert_losses_match(actual: Any, expected: Any, rtol: float, own_init: tuple[str, ...] = ()) -> None:
    got, want = flatten(actual), flatten(expected)
    assert got.keys() == want.keys(), f"different steps: {sorted(got.keys() ^ want.keys())}"
    own = {k for k in want if k.split("/")[0] in own_init}
    assert all(math.isfinite(got[k]) for k in own), {k: got[k] for k in own}
    bad = {
        k: (got[k], want[k])
        for k in want
        if k not in own and not math.isclose(got[k], want[k], rel_tol=rtol, abs_tol=0.0)
    }
    assert not bad, f"{len(bad)} of {len(want)} losses differ beyond rtol {rtol} (zeroshard, deepspeed): {bad}"


def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_zeroshard_matches_deepspeed(case: Case, tmp_path: Path) -> None:
    actual = losses_of(run_script(case, "zeroshard", tmp_path), f"{case.script} under zeroshard")
    assert_losses_match(actual, reference()[case.name], case.rtol, case.own_init)


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_reference_is_deepspeed(case: Case, tmp_path: Path) -> None:
    from helpers.deepspeed_reference import import_deepspeed

    import_deepspeed()
    actual = losses_of(run_script(case, "deepspeed", tmp_path), f"{case.script} under DeepSpeed")
    # the case's own tolerance: DeepSpeed's bf16 losses depend on the CPU's bf16 kernels (on an AVX512-BF16 EPYC its
    # cifar bf16 stage-2 loss at step 3 is one bf16 ulp from the one recorded on the machine that wrote the file)
    assert_losses_match(actual, reference()[case.name], case.rtol)


def test_pipeline_script_matches_deepspeed(tmp_path: Path) -> None:
    actual = losses_of(run_script(PIPELINE, "zeroshard", tmp_path), "pipeline_train.py under zeroshard")
    assert_losses_match(actual, reference()[PIPELINE.name], PIPELINE.rtol)


@pytest.mark.slow
def test_pipeline_script_runs_under_deepspeed(tmp_path: Path) -> None:
    from helpers.deepspeed_reference import import_deepspeed

    import_deepspeed()
    losses = losses_of(run_script(PIPELINE, "deepspeed", tmp_path), "pipeline_train.py under DeepSpeed")
    assert_losses_match(losses, reference()[PIPELINE.name], FP32_RTOL)


def accelerate_run(
    tmp: Path, config: dict[str, Any] | None, lib: str = "zeroshard", args: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """The Accelerate script on 2 ranks: with `config` through accelerate's DeepSpeed settings, else accelerate's
    own data-parallel run on the CPU (no plugin)."""
    env = (("ACCELERATE_USE_CPU", "true"),) if config is None else ()
    args = ("--output_dir", "{tmp}/out", *args)
    case = Case("accelerate", ACCELERATE_SCRIPT, args, accelerate_config=config, env=env)
    result: dict[str, list[float]] = losses_of(run_script(case, lib, tmp), f"{ACCELERATE_SCRIPT} ({lib}, {config})")
    return result


@pytest.mark.slow  # secondary: one process against DeepSpeed in the cases above, 2 ranks in the ALST test
def test_accelerate_script_on_two_ranks(tmp_path: Path) -> None:
    """Accelerate's DeepSpeed mode needs an accelerator for more than one process, so on 2 CPU ranks the reference
    is accelerate's own DDP run of the same script (no DeepSpeed plugin; gradient clipping off, as there): ZeRO-2
    under `zeroshard.hf.Accelerator` gives the same losses, learning rates and evaluations; resuming from the
    step-2 state gives the uninterrupted run's last losses."""
    ddp = accelerate_run(tmp_path / "ddp", None, lib="accelerate")
    zero2 = accelerate_run(tmp_path / "zero2", {**ACCELERATE_ZERO2, "gradient_clipping": 0.0})
    assert_losses_match(zero2, ddp, FP32_RTOL)
    assert zero2["resumed"] == zero2["train"][-len(zero2["resumed"]) :]


@pytest.mark.slow
def test_accelerate_script_zero3_on_two_ranks(tmp_path: Path) -> None:
    """2 ranks, the config's optimizer and scheduler (DummyOptim, DummyScheduler): ZeRO-3 equals ZeRO-2; the model
    loaded with from_pretrained under zeroshard.zero_init() (each rank reads its shards) trains as the one loaded
    whole."""
    zero3 = accelerate_run(tmp_path / "zero3", ACCELERATE_ZERO3)
    zero2 = accelerate_run(tmp_path / "zero2", {**ACCELERATE_ZERO3, "zero_optimization": {"stage": 2}})
    assert_losses_match(zero3, zero2, FP32_RTOL)
    assert zero3["resumed"] == zero3["train"][-len(zero3["resumed"]) :]
    folder = ("--model_name_or_path", str(tmp_path / "zero3" / "out" / "final"))
    whole = accelerate_run(tmp_path / "whole", ACCELERATE_ZERO3, args=folder)
    streamed = accelerate_run(tmp_path / "streamed", ACCELERATE_ZERO3, args=(*folder, "--zero_init"))
    assert_losses_match(streamed, whole, FP32_RTOL)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by Accelerate scripts:
# test_zeroshard_matches_deepspeed[accelerate_zero2_adamw]
@pytest.mark.slow
def test_accelerate_script_without_deepspeed(tmp_path: Path) -> None:
    """The ZeRO-3 case above with DeepSpeed hidden (scripts/without_deepspeed.py), as on a machine without it, and
    launched as `accelerate launch` would from a config file: by `zeroshard accelerate-launch` ([Note: accelerate
    launch without DeepSpeed]). accelerate then exports neither DummyOptim nor the names its save_state/load_state
    use; the losses, learning rates and evaluations are still DeepSpeed's."""
    case = Case(
        "without",
        "without_deepspeed.py",
        (ACCELERATE_SCRIPT, "--output_dir", "{tmp}/out"),
        nproc=1,
        accelerate_config=ACCELERATE_ZERO3,
    )
    done = run_script(case, "zeroshard", tmp_path, accelerate_launch=True)
    losses = losses_of(done, f"{ACCELERATE_SCRIPT} without DeepSpeed, by zeroshard accelerate-launch")
    assert_losses_match(losses, reference()["accelerate_zero3_dummy_optim"], FP32_RTOL)


ALST_SCRIPT = "accelerate_ds_alst_ulysses_sp.py"


def alst_reference() -> list[float]:
    """accelerate_ds_alst_ulysses_sp.py's model and samples on one process, whole sequences, in the order the 2 ranks'
    loaders and the adapter give them, with the gradient doubled: the parts' losses all-gathered differentiably give
    P times the single-process gradient, under DeepSpeed as here (README, sequence parallelism); clipping at 1.0."""
    from accelerate.utils import set_seed
    from transformers import LlamaConfig, LlamaForCausalLM

    set_seed(42)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    input_ids = torch.arange(1, 32 * 4 + 1).view(-1, 32) + 100
    losses = []
    for ids in input_ids:
        optimizer.zero_grad()
        loss = model(input_ids=ids[None], position_ids=torch.arange(32)[None], labels=ids[None]).loss
        (2 * loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=pytest.mark.slow) for s in (3, 2)]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_accelerate_alst_script_on_two_ranks(tmp_path: Path, stage: int) -> None:
    """accelerate's own ALST test script (sp 2 on 2 ranks, its loss combination) under zeroshard.hf.Accelerator
    equals the whole sequences trained on one process, every step (accelerate's DeepSpeed mode, which counts one
    process on this CPU machine, cannot be the reference)."""
    config = {
        "zero_optimization": {"stage": stage},
        "gradient_accumulation_steps": 1,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    case = Case("alst", ALST_SCRIPT, accelerate_config=config)
    losses = losses_of(run_script(case, "zeroshard", tmp_path), f"{ALST_SCRIPT} under zeroshard")
    assert_losses_match(losses, alst_reference(), 1e-5)


def write_reference(names: list[str]) -> None:
    """Record DeepSpeed's losses for the named cases, or for every case (run by hand after changing a script)."""
    import tempfile

    results = reference() if names else {}
    for case in [c for c in [*CASES, PIPELINE] if not names or c.name in names]:
        with tempfile.TemporaryDirectory() as tmp:
            done = run_script(case, "deepspeed", Path(tmp))
        lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
        if done.returncode != 0 or len(lines) != 1:
            raise SystemExit(f"{case.name} failed under DeepSpeed:\n{done.stderr[-3000:]}")
        results[case.name] = json.loads(lines[0][len(MARKER) :])["losses"]
        print(case.name, "recorded", flush=True)
    REFERENCE.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    write_reference(sys.argv[1:])


# DeepSpeedExamples bing_bert's LAMB configs (deepspeed_bsz64k_lamb_config_seq128.json: FusedLamb without bias
# correction, trust ratios clamped to [0.01, 0.3]), at this test's batch and in fp32. DeepSpeed's FusedLamb is a CUDA
# extension, so no DeepSpeed run on this CPU records a reference: zeroshard's LAMB is checked against DeepSpeed's
# kernel formula and a single process in tests/unit/test_optimizers.py and tests/distributed/test_lamb.py.
BING_BERT_LAMB = {
    **BING_BERT_CONFIG,
    "optimizer": {
        "type": "Lamb",
        "params": {"lr": 4e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01},
    },
}


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the script's fp32 case against
# DeepSpeed (bing_bert_fp32_resume) and Lamb's parity tests (tests/distributed/test_lamb.py)
@pytest.mark.slow
def test_bing_bert_trains_with_its_lamb_config(tmp_path: Path) -> None:
    """The script reads `optimizer_name() == LAMB_OPTIMIZER`, trains, saves, reloads and trains on: every loss finite,
    the first epoch's falling."""
    case = Case(
        "bing_bert_lamb", "bing_bert_deepspeed_train.py", ("--output_dir", "{tmp}/saved_models"), BING_BERT_LAMB
    )
    losses = list(flatten(losses_of(run_script(case, "zeroshard", tmp_path), "bing_bert with LAMB")).values())
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert losses[len(losses) // 2 - 1] < losses[0], losses
