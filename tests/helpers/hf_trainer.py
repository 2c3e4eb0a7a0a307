"""A tiny Llama, a token dataset and a loss recorder for the `zeroshard.hf.Trainer` tests (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
SEQ = 16


def tiny_llama(seed: int = 0, vocab: int = VOCAB) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


class Tokens(torch.utils.data.Dataset):
    """`n` learnable sequences (a random start counting up by a random stride of 1-3); labels are the inputs."""

    def __init__(self, n: int = 32, seed: int = 1):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=generator)
        stride = torch.randint(1, 4, (n, 1), generator=generator)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def loss_recorder() -> Any:
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return Losses()


def arguments(output_dir: str, **overrides: Any) -> dict[str, Any]:
    """TrainingArguments keywords shared by the reference and the zeroshard run."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return kwargs


def ds_config(stage: int, optimizer: bool = True, **extra: Any) -> dict[str, Any]:
    """A ds_config whose every Trainer-controlled value is "auto", as transformers' examples write them."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
    if optimizer:
        params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
        config["optimizer"] = {"type": "AdamW", "params": params}
    config.update(extra)
    return config
