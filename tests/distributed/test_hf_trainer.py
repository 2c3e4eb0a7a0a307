"""`zeroshard.hf.Trainer` against the plain `transformers.Trainer`, and its save / resume / load on 2 ranks.

Each body runs in spawned ranks (`run_on_ranks`), so no process group outlives a test in the pytest process.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import Tokens, arguments, ds_config, loss_recorder, tiny_llama, with_lora

pytest.importorskip("transformers")
pytest.importorskip("peft")

REL = 1e-5


def _plain_losses(out: str, model: Any, data: Any, **overrides: Any) -> list[float]:
    import transformers

    record = loss_recorder()
    args = transformers.TrainingArguments(**arguments(out, **overrides))
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[record]).train()
    return list(record.losses)


def _zeroshard_losses(out: str, model: Any, data: Any, config: dict[str, Any] | None, **overrides: Any) -> list[float]:
    from zeroshard.hf import Trainer, TrainingArguments

    record = loss_recorder()
    args = TrainingArguments(**arguments(out, deepspeed=config, **overrides))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[record])
    trainer.train()
    assert trainer.engine is not None
    if config is None:  # from accelerate launch's variables
        assert int(trainer.engine.config.zero_optimization.stage) == int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    trainer.engine.destroy()
    return list(record.losses)


# 36 samples, 4 per batch, 2 per window: 9 batches an epoch, so each epoch ends on a one-batch window
CASES = {  # name: (stage, optimizer block in the config, LoRA, more arguments)
    "stage3-config-optimizer": (3, True, False, {}),
    "stage3-trainer-optimizer": (3, False, False, {"weight_decay": 0.1}),
    "stage3-lora": (3, True, True, {}),
    "stage2-config-optimizer": (2, True, False, {}),
    "stage1-lora": (1, True, True, {}),
    "stage1-unmanaged": (1, True, False, {}),
}
# CI budget: stages 1-2 of the other two stage-3 cases; LoRA at stage 3 (test_stage3_features.py) and caller-owned
# windows (test_managed_accumulation.py) are covered without the Trainer
# ... and the launched config (`accelerate launch`'s variables: test_accelerate_* in tests/compat)
SLOW = {"stage2-config-optimizer", "stage1-lora", "stage3-lora", "stage1-unmanaged", "stage3-trainer-optimizer"}
# managed_gradient_accumulation false ([Note: caller-owned windows]): the Trainer's windows, the epoch's short one too
UNMANAGED = {"stage1-unmanaged"}


# the config arrives as `accelerate launch` (zeroshard accelerate-launch) gives it: variables, no deepspeed=
# ([Note: accelerate launch's DeepSpeed for the Trainer])
LAUNCHED = {"stage3-trainer-optimizer"}


def _ws1_parity(rank: int, world_size: int, tmp: str, name: str) -> tuple[list[float], list[float]]:
    torch.set_num_threads(2)
    stage, optimizer, lora, overrides = CASES[name]
    data = Tokens(36)
    build = (lambda: with_lora(tiny_llama())) if lora else tiny_llama
    plain = _plain_losses(os.path.join(tmp, "plain"), build(), data, num_train_epochs=2, **overrides)
    config: dict[str, Any] | None = ds_config(stage, optimizer)
    if name in UNMANAGED:
        config = {**ds_config(stage, optimizer), "managed_gradient_accumulation": False}
    if name in LAUNCHED:
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage))
        config = None
    ours = _zeroshard_losses(os.path.join(tmp, "zs"), build(), data, config, num_train_epochs=2, **overrides)
    return plain, ours


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES])
def test_world_size_1_losses_equal_the_plain_trainer(tmp_path, name):
    plain, ours = run_on_ranks(_ws1_parity, 1, str(tmp_path), name)[0]
    assert len(plain) == len(ours) == 10
    assert plain[-1] < plain[0]  # it learns
    for step, (a, b) in enumerate(zip(plain, ours, strict=True)):
        assert math.isclose(a, b, rel_tol=REL), f"step {step}: plain {a} zeroshard {b}"


def _train_save_resume(rank: int, world_size: int, tmp: str, lora: bool) -> dict[str, Any]:
    from zeroshard.hf import Trainer, TrainingArguments

    def build() -> Any:
        return with_lora(tiny_llama()) if lora else tiny_llama()

    config = ds_config(3, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    out = os.path.join(tmp, "run")
    kwargs = arguments(
        out, deepspeed=config, per_device_train_batch_size=2, num_train_epochs=2, save_strategy="steps", save_steps=3
    )
    data, evaluation = Tokens(32), Tokens(8, seed=2)

    def trainer(record: Any) -> Any:
        args = TrainingArguments(**kwargs)
        return Trainer(model=build(), args=args, train_dataset=data, eval_dataset=evaluation, callbacks=[record])

    full = loss_recorder()
    first = trainer(full)
    first.train()
    resumed_record = loss_recorder()
    second = trainer(resumed_record)
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))

    final = os.path.join(tmp, "final")
    second.save_model(final)
    engine = second.engine
    weights = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    eval_loss = second.evaluate()["eval_loss"]
    predictions = second.predict(evaluation).predictions
    prompt = evaluation.ids[:2, :6]
    generated = second.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    return {
        "full": full.losses,
        "resumed": resumed_record.losses,
        "weights": weights if rank == 0 else None,
        "eval_loss": eval_loss,
        "predictions_shape": tuple(predictions.shape),
        "generated": generated,
        "checkpoint": sorted(os.listdir(os.path.join(out, "checkpoint-3"))),
        "sharded": None if lora else _sharded_cases(rank, tmp),  # (cases sharing this spawn)
    }


def _load_saved(folder: str, lora: bool) -> Any:
    from transformers import LlamaForCausalLM

    if lora:
        from peft import PeftModel

        return PeftModel.from_pretrained(tiny_llama(), folder)
    return LlamaForCausalLM.from_pretrained(folder)


def _eval_loss(model: Any) -> float:
    data = Tokens(8, seed=2)
    with torch.no_grad():
        losses = [model(input_ids=data.ids[i : i + 2], labels=data.ids[i : i + 2]).loss for i in range(0, 8, 2)]
    return float(torch.stack(losses).mean())


SHARDED = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
SCHEDULER = {  # its "auto" total_num_steps is 0 where nothing is trained
    "type": "WarmupDecayLR",
    "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")},
}


def _sharded_cases(rank: int, tmp: str) -> dict[str, Any]:
    """ZeRO-3 checkpoints without gathering, an evaluation-only run and save_only_model with load_best_model_at_end,
    as transformers runs them under DeepSpeed 0.19.8; in the 2-rank spawn of `_train_save_resume`."""
    from zeroshard.errors import ConfigError
    from zeroshard.hf import Trainer, TrainingArguments

    def trainer(name: str, model: Any, config: dict[str, Any], train: bool = True, **overrides: Any) -> Any:
        out = os.path.join(tmp, f"sharded-{name}")
        args = TrainingArguments(**arguments(out, deepspeed=config, per_device_eval_batch_size=2, **overrides))
        data = Tokens(24) if train else None
        return Trainer(model=model, args=args, train_dataset=data, eval_dataset=Tokens(8, seed=2))

    listings: dict[str, list[str]] = {}
    saving = dict(per_device_train_batch_size=2, max_steps=3, save_strategy="steps", save_steps=3)
    for name, model, save_only in (("full", tiny_llama(), True), ("lora", with_lora(tiny_llama()), False)):
        run = trainer(name, model, ds_config(3, zero_optimization=SHARDED), save_only_model=save_only, **saving)
        run.train()
        listings[name] = sorted(os.listdir(os.path.join(tmp, f"sharded-{name}", "checkpoint-3")))
    lora_weights = {k: v for k, v in run.engine.consolidated_state_dict().items() if "lora_" in k}

    # evaluate() with nothing to train: an engine without optimizer and scheduler, as DeepSpeed's inference engine
    evaluating = trainer("eval", tiny_llama(), ds_config(3, scheduler=SCHEDULER), train=False)
    eval_loss = evaluating.evaluate()["eval_loss"]
    no_optimizer = evaluating.engine.optimizer is None and evaluating.optimizer is None

    best = dict(save_only_model=True, load_best_model_at_end=True, eval_strategy="steps", **saving)
    try:
        trainer("best", tiny_llama(), ds_config(2), **best)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {
        "listings": listings,
        "lora": lora_weights if rank == 0 else None,
        "eval_loss": eval_loss,
        "no_optimizer": no_optimizer,
        "refused": refused,
    }


def _check_sharded(results: list[dict[str, Any]], tmp_path: Any) -> None:
    """At ZeRO-3 without gathering, checkpoint-N holds what transformers writes there under DeepSpeed: the model's
    config and training_args.bin with the engine checkpoint (which save_only_model keeps too, as the weights' only
    copy), a PEFT model's adapter; evaluate() with nothing to train builds the engine without the config's optimizer
    and scheduler; save_only_model with load_best_model_at_end is refused when the Trainer is built."""
    ours = results[0]["sharded"]
    full, lora = ours["listings"]["full"], ours["listings"]["lora"]
    for name in ("config.json", "generation_config.json", "training_args.bin", "latest", "trainer_state.json"):
        assert name in full, full
    assert "model.safetensors" not in full and not any(n.startswith("rng_state") for n in full), full
    for name in ("adapter_config.json", "adapter_model.safetensors", "training_args.bin", "latest"):
        assert name in lora, lora
    assert "config.json" not in lora and "model.safetensors" not in lora, lora
    adapter = _load_saved(str(tmp_path / "sharded-lora" / "checkpoint-3"), lora=True).state_dict()
    assert ours["lora"]
    for name, value in ours["lora"].items():
        assert torch.equal(adapter[name], value), name
    for result in (r["sharded"] for r in results):
        assert math.isclose(result["eval_loss"], _eval_loss(tiny_llama().eval()), rel_tol=REL)
        assert result["no_optimizer"]
        assert "save_only_model with load_best_model_at_end is not supported" in result["refused"], result["refused"]


# LoRA on 2 ranks is slow-marked (CI budget); LoRA parity at world size 1 stays in the default suite
@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_two_ranks_train_save_resume_and_load(tmp_path, lora):
    results = run_on_ranks(_train_save_resume, 2, str(tmp_path), lora)
    ours = results[0]
    assert len(ours["full"]) == 8 and ours["full"][-1] < ours["full"][0]
    assert len(ours["resumed"]) == 5  # steps 4..8 after checkpoint-3
    for step, (a, b) in enumerate(zip(ours["full"][3:], ours["resumed"], strict=True)):
        assert math.isclose(a, b, rel_tol=REL), f"step {step + 4}: uninterrupted {a} resumed {b}"
    assert "latest" in ours["checkpoint"] and "global_step3" in ours["checkpoint"]
    assert "trainer_state.json" in ours["checkpoint"]

    model = _load_saved(str(tmp_path / "final"), lora).eval()
    loaded = model.state_dict()
    for name, value in ours["weights"].items():
        if lora and "lora_" not in name:
            continue
        assert torch.equal(loaded[name], value), name
    assert math.isclose(ours["eval_loss"], _eval_loss(model), rel_tol=REL)
    assert results[1]["eval_loss"] == ours["eval_loss"]
    assert ours["predictions_shape"] == (8, 16, 128)
    expected = model.generate(input_ids=Tokens(8, seed=2).ids[:2, :6], max_new_tokens=4, do_sample=False)
    assert torch.equal(ours["generated"], expected)
    assert torch.equal(results[1]["generated"], expected)
    if not lora:
        _check_sharded(results, tmp_path)


def _sft_parity(rank: int, world_size: int, tmp: str) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import ByT5Tokenizer
    from trl import SFTConfig, SFTTrainer

    from zeroshard.hf import TrainerMixin, TrainingArgumentsMixin

    class SFT(TrainerMixin, SFTTrainer):
        pass

    class Config(TrainingArgumentsMixin, SFTConfig):
        pass

    torch.set_num_threads(2)
    data = Dataset.from_dict({"input_ids": Tokens(36).ids.tolist()})
    tokenizer = ByT5Tokenizer(extra_ids=0)  # SFTTrainer wants one; the data is already tokenized
    kwargs = arguments(os.path.join(tmp, "sft"), num_train_epochs=2, bf16=False)  # SFTConfig defaults to bf16
    plain, ours = loss_recorder(), loss_recorder()
    args = SFTConfig(**kwargs)
    SFTTrainer(model=tiny_llama(), args=args, train_dataset=data, processing_class=tokenizer, callbacks=[plain]).train()
    args = Config(deepspeed=ds_config(3), **kwargs)
    SFT(model=tiny_llama(), args=args, train_dataset=data, processing_class=tokenizer, callbacks=[ours]).train()
    return plain.losses, ours.losses


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the Trainer mixin:
# test_world_size_1_losses_equal_the_plain_trainer
@pytest.mark.slow
def test_trl_sft_trainer_through_the_mixin_equals_plain_sft_trainer(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    plain, ours = run_on_ranks(_sft_parity, 1, str(tmp_path))[0]
    assert len(plain) == len(ours) == 10 and plain[-1] < plain[0]
    for step, (a, b) in enumerate(zip(plain, ours, strict=True)):
        assert math.isclose(a, b, rel_tol=REL), f"step {step}: SFTTrainer {a} zeroshard {b}"


def _dpo_parity(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import ByT5Tokenizer
    from trl import DPOConfig, DPOTrainer

    from zeroshard import Engine
    from zeroshard.errors import ConfigError
    from zeroshard.hf import TrainerMixin, TrainingArgumentsMixin

    class DPO(TrainerMixin, DPOTrainer):
        pass

    class Config(TrainingArgumentsMixin, DPOConfig):
        pass

    def model() -> Any:
        return tiny_llama(vocab=384)  # ByT5's ids reach 258

    n = 16
    data = Dataset.from_dict(
        {
            "prompt": [f"q{i}: " for i in range(n)],
            "chosen": [f"yes {i}" for i in range(n)],
            "rejected": [f"no {3 * i}" for i in range(n)],
        }
    )
    tokenizer = ByT5Tokenizer(extra_ids=0)
    kwargs = arguments(
        os.path.join(tmp, "dpo"), per_device_train_batch_size=2, learning_rate=1e-3, warmup_steps=0, bf16=False
    )
    plain, ours = loss_recorder(), loss_recorder()
    DPOTrainer(
        model=model(),
        ref_model=model(),
        args=DPOConfig(**kwargs),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[plain],
    ).train()
    config = ds_config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every unit sharded, even a tiny one
    args = Config(deepspeed=config, **kwargs)
    trainer = DPO(
        model=model(), ref_model=model(), args=args, train_dataset=data, processing_class=tokenizer, callbacks=[ours]
    )
    trainer.train()
    ref = trainer.ref_model
    sharded = isinstance(ref, Engine) and ref.zero_stage == 3 and ref.optimizer is None and not ref.training
    # TRL's sync of the reference reads the parameters directly (it gathers them only through DeepSpeed)
    args = Config(deepspeed=config, sync_ref_model=True, ref_model_sync_steps=1, **kwargs)
    syncing = DPO(model=model(), ref_model=model(), args=args, train_dataset=data, processing_class=tokenizer)
    try:
        syncing.train()
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {"plain": plain.losses, "ours": ours.losses, "ref_sharded": sharded, "sync_refused": refused}


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the Trainer at stage 3:
# test_world_size_1_losses_equal_the_plain_trainer
@pytest.mark.slow
def test_trl_dpo_reference_model_is_sharded_at_stage3(tmp_path):
    """TRL's DPOTrainer through the mixin on 2 ranks at ZeRO-3: the reference model becomes a stage-3 engine without
    optimizer (as TRL's prepare_deepspeed makes it under DeepSpeed) and the losses equal the plain DPOTrainer's;
    sync_ref_model is refused there in one line."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    for result in run_on_ranks(_dpo_parity, 2, str(tmp_path), timeout=600):
        assert result["ref_sharded"]
        assert "sync_ref_model with zero_optimization.stage 3" in result["sync_refused"], result["sync_refused"]
        assert len(result["plain"]) == len(result["ours"]) == 2 and result["plain"][-1] < result["plain"][0]
        for step, (a, b) in enumerate(zip(result["plain"], result["ours"], strict=True)):
            assert math.isclose(a, b, rel_tol=REL), f"step {step}: DPOTrainer {a} zeroshard {b}"


def _streamed_model(rank: int, world_size: int, tmp: str, folder: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import zeroshard
    from zeroshard.hf import Trainer, TrainingArguments

    def losses(model: Any = None, model_init: Any = None) -> tuple[list[float], Any]:
        record = loss_recorder()
        args = TrainingArguments(**arguments(os.path.join(tmp, "out"), deepspeed=ds_config(3), max_steps=4))
        trainer = Trainer(model=model, model_init=model_init, args=args, train_dataset=Tokens(32), callbacks=[record])
        built = trainer.model
        trainer.train()
        trainer.engine.destroy()
        return record.losses, built

    whole, _ = losses(LlamaForCausalLM.from_pretrained(folder))
    with zeroshard.zero_init():
        meta = LlamaForCausalLM.from_pretrained(folder)
    streamed, _ = losses(meta)
    from_init, built = losses(model_init=lambda: LlamaForCausalLM.from_pretrained(folder))
    return {"whole": whole, "streamed": streamed, "model_init": from_init, "meta": built.lm_head.weight.is_meta}


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by streaming: test_streaming_load.py
@pytest.mark.slow
def test_a_model_streamed_under_zero_init_trains_as_the_whole_one(tmp_path):
    folder = str(tmp_path / "llama")
    tiny_llama().save_pretrained(folder)
    out = run_on_ranks(_streamed_model, 2, str(tmp_path), folder)[0]
    assert out["meta"]  # model_init ran under zero_init at stage 3
    assert len(out["whole"]) == 4
    for name in ("streamed", "model_init"):
        for step, (a, b) in enumerate(zip(out["whole"], out[name], strict=True)):
            assert math.isclose(a, b, rel_tol=REL), f"{name} step {step}: {a} vs {b}"


@pytest.mark.slow
def test_the_example_runs_under_zeroshard_launch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    command = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", "examples/hf_trainer.py"]
    flags = ["--deepspeed", "examples/ds_config_hf.json", "--max_steps", "4", "--save_steps", "2", "--eval_steps", "4"]
    flags += ["--use_cpu", "--disable_tqdm", "true", "--output_dir", str(tmp_path)]
    out = subprocess.run(command + flags, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sample: 'def " in out.stdout
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "checkpoint-2" / "latest").exists()


def _node_local_without_save_on_each_node(rank: int, world_size: int, tmp: str) -> str:
    from zeroshard.errors import ConfigError
    from zeroshard.hf import Trainer, TrainingArguments

    config = {**ds_config(2), "checkpoint": {"use_node_local_storage": True}}
    trainer = Trainer(
        model=tiny_llama(), args=TrainingArguments(**arguments(tmp, deepspeed=config)), train_dataset=Tokens(8)
    )
    try:
        trainer.train()
    except ConfigError as e:
        return str(e)
    return ""


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by node-local checkpoints:
# test_node_local_checkpoint.py
@pytest.mark.slow
def test_node_local_checkpoints_need_each_node_to_save_its_trainer_state(tmp_path):
    """[Note: node-local checkpoints]: without save_on_each_node only node 0 would write trainer_state.json and rotate
    its checkpoint-N folders; refused before training starts."""
    (message,) = run_on_ranks(_node_local_without_save_on_each_node, 1, str(tmp_path))
    assert "set save_on_each_node=True" in message, message


def _node_local_trainer(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """4 ranks as 2 nodes of 2, each node its own output_dir: the Trainer with save_on_each_node."""
    from zeroshard.hf import Trainer, TrainingArguments

    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    config = {**ds_config(1), "checkpoint": {"use_node_local_storage": True}}
    out = os.path.join(tmp, f"node{rank // 2}")
    kwargs = arguments(
        out,
        deepspeed=config,
        per_device_train_batch_size=2,
        num_train_epochs=2,
        save_strategy="steps",
        save_steps=3,
        save_on_each_node=True,
    )
    data = Tokens(32)

    def trainer(record: Any) -> Any:
        return Trainer(model=tiny_llama(), args=TrainingArguments(**kwargs), train_dataset=data, callbacks=[record])

    full, resumed = loss_recorder(), loss_recorder()
    trainer(full).train()
    second = trainer(resumed)
    second.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    second.engine.destroy()
    return {"full": full.losses, "resumed": resumed.losses, "checkpoint": sorted(os.listdir(out + "/checkpoint-3"))}


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by node-local checkpoints:
# test_node_local_checkpoint.py
@pytest.mark.slow
def test_node_local_checkpoints_under_the_trainer_resume_on_each_node(tmp_path):
    """[Note: node-local checkpoints] with save_on_each_node: each node's folder gets its trainer_state.json and its
    ranks' engine files, and a resume from checkpoint-3 continues with the uninterrupted run's losses."""
    for got in run_on_ranks(_node_local_trainer, 4, str(tmp_path), timeout=600):
        assert got["resumed"] == got["full"][-len(got["resumed"]) :] and got["resumed"], got
        assert "trainer_state.json" in got["checkpoint"] and "global_step3" in got["checkpoint"], got["checkpoint"]
    for node in (0, 1):
        engine_files = sorted(os.listdir(tmp_path / f"node{node}" / "checkpoint-3" / "global_step3" / "optim"))
        assert engine_files == [f"rank{r:05d}.safetensors" for r in (2 * node, 2 * node + 1)], engine_files
