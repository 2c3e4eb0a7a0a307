"""The ds_config a `zeroshard.hf.Trainer` run resolves from its TrainingArguments, as transformers fills "auto"."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from zeroshard.errors import ConfigError  # noqa: E402
from zeroshard.hf import TrainingArguments, trainer_config, trainer_known  # noqa: E402
from zeroshard.hf.auto import hidden_size, mismatches  # noqa: E402

AUTO_EVERYWHERE = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def _args(**overrides):
    kwargs = dict(
        output_dir="unused",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        learning_rate=3e-4,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.1,
        max_grad_norm=0.5,
        warmup_steps=0.1,  # a fraction: 10% of the steps
        use_cpu=True,
        report_to=[],
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _model(hidden=64):
    return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))


def test_every_auto_is_filled_as_transformers_fills_it():
    cfg = trainer_config(AUTO_EVERYWHERE, _args(), _model(64), num_training_steps=200, world_size=2)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 3, 24)
    assert cfg.gradient_clipping == 0.5
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 20,
        "total_num_steps": 200,
    }
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.stage3_param_persistence_threshold == 10 * 64
    # transformers fills the dict in place before DeepSpeed sees it: engine.config[...] reads the filled values
    assert cfg["optimizer"]["params"] == cfg.optimizer.params and cfg["gradient_clipping"] == 0.5
    assert cfg["train_batch_size"] == 24 and cfg["fp16"] == {"enabled": False}
    assert "auto" not in repr(cfg.raw) and cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_bf16_and_warmup_follow_the_arguments():
    known = trainer_known(_args(bf16=True, warmup_steps=0), _model(), num_training_steps=50, world_size=1)
    assert known["bf16.enabled"] is True and known["fp16.enabled"] is False
    assert known["scheduler.params.warmup_num_steps"] == 1  # transformers keeps it positive for DeepSpeed >= 0.19.6


def test_set_values_that_contradict_the_arguments_are_refused_by_name():
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95]}},
        "zero_optimization": {"stage": 2},
    }
    with pytest.raises(ConfigError) as err:
        trainer_config(config, _args(), _model(), num_training_steps=10, world_size=1)
    message = str(err.value)
    assert "train_micro_batch_size_per_gpu=8" in message and "optimizer.params.lr=0.001" in message
    assert "gradient_clipping" not in message and "betas" not in message  # these agree


def test_absent_keys_stay_absent_except_the_batch():
    cfg = trainer_config({"zero_optimization": {"stage": 1}}, _args(), _model(), num_training_steps=10, world_size=2)
    assert cfg.train_batch_size == 24 and cfg.gradient_clipping == 1.0  # the ds_config default, not max_grad_norm
    assert cfg.optimizer is None and cfg.scheduler is None  # the Trainer's own then


def test_the_hidden_size_rules_of_transformers():
    assert hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[32, 96, 64]))) == 96
    text = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=48)))
    assert hidden_size(text) == 48
    assert hidden_size(SimpleNamespace()) is None
    with pytest.raises(ConfigError, match="neither hidden_size nor hidden_sizes"):
        trainer_config(AUTO_EVERYWHERE, _args(), SimpleNamespace(), num_training_steps=10, world_size=1)


def test_mismatches_compare_numbers_and_lists_by_value():
    known = {"optimizer.params.betas": [0.9, 0.999], "gradient_clipping": 1.0, "fp16.enabled": False}
    user = {"optimizer": {"params": {"betas": (0.9, 0.999)}}, "gradient_clipping": 1, "fp16": {"enabled": "auto"}}
    assert mismatches(user, known) == []
    assert mismatches({"gradient_clipping": 2}, known) == ["- ds gradient_clipping=2 vs the Trainer's 1.0"]


def test_training_arguments_keep_deepspeed_for_zeroshard():
    args = _args(deepspeed={"zero_optimization": {"stage": 3}})
    assert args.deepspeed is None and args.zeroshard_config == {"zero_optimization": {"stage": 3}}
    assert args.deepspeed_plugin is None and getattr(args, "hf_deepspeed_config", None) is None
    assert pickle.loads(pickle.dumps(args)).zeroshard_config == {"zero_optimization": {"stage": 3}}


def test_the_command_line_deepspeed_flag_is_parsed_as_before(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--deepspeed", "ds_config.json", "--use_cpu", "--report_to", "none"]
    )
    assert isinstance(args, TrainingArguments) and args.zeroshard_config == "ds_config.json"


def test_the_trainer_needs_a_config_and_refuses_deepspeeds_arguments():
    from zeroshard.hf.arguments import config_source as _config_source

    with pytest.raises(ConfigError, match="no ds_config"):
        _config_source(_args(), None)
    with pytest.raises(ConfigError, match="already handed to DeepSpeed"):
        _config_source(SimpleNamespace(deepspeed="ds.json"), None)
    with pytest.raises(ConfigError, match="both"):
        _config_source(_args(deepspeed={"zero_optimization": {"stage": 1}}), {"zero_optimization": {"stage": 2}})
    assert _config_source(_args(), {"zero_optimization": {"stage": 2}}).zero_optimization.stage == 2


def test_a_lone_process_on_several_gpus_trains_one_micro_batch_per_step(tmp_path):
    """transformers' plain path (no DeepSpeed) counts a single process's GPUs for nn.DataParallel: its DataLoader
    fed N micro-batches as one and the loss divided the token count by N. The Trainer keeps one device per process,
    as DeepSpeed's branch does (simulated: the CPU counts no GPU)."""
    from torch import nn

    from zeroshard.hf import Trainer

    args = _args(deepspeed={"zero_optimization": {"stage": 2}}, output_dir=str(tmp_path))  # a Trainer makes it
    _ = args.device
    args._n_gpu = 2  # what transformers sets from torch.cuda.device_count() without torchrun
    trainer = Trainer(model=nn.Linear(4, 4), args=args)
    assert trainer.args.n_gpu == 1 and trainer._train_batch_size == args.per_device_train_batch_size == 4


def test_a_trl_style_trainer_takes_its_reference_model_by_position(tmp_path):
    """TRL's DPO takes (model, ref_model, args, ...): the arguments are read by name (the second position was taken
    for the TrainingArguments and its n_gpu read from a model)."""
    import transformers
    from torch import nn

    from zeroshard.hf import TrainerMixin

    class DPOLike(transformers.Trainer):
        def __init__(self, model, ref_model=None, args=None, **kwargs):
            self.ref_model = ref_model
            super().__init__(model=model, args=args, **kwargs)

    class Trainer(TrainerMixin, DPOLike):
        pass

    args = _args(deepspeed={"zero_optimization": {"stage": 2}}, output_dir=str(tmp_path))
    reference = nn.Linear(4, 4)
    trainer = Trainer(nn.Linear(4, 4), reference, args)
    assert trainer.args is args and trainer.ref_model is reference
