"""BERT pre-training (masked LM + next sentence) through the DeepSpeed API, on synthetic batches.

Re-created (trimmed, rewritten) from DeepSpeedExamples `training/bing_bert/deepspeed_train.py`,
commit 45b4b7156c8794a3452a5a7d03dbd8d797068569. Kept as upstream: `add_config_arguments` with
`--deepspeed_config`, `init_distributed(dist_backend=...)`, the weight-decay parameter groups read against the
JSON config, `initialize(args=, model=, model_parameters=)`, `train_micro_batch_size_per_gpu()`,
`gradient_accumulation_steps()`, `local_rank`, `device`, `fp16_enabled()`, `optimizer_name()` against
`deepspeed.runtime.config.LAMB_OPTIMIZER`, `is_gradient_accumulation_boundary()`, `backward`/`step` on every
micro step, `save_checkpoint(PATH, ckpt_id, client_state)` and `load_checkpoint(PATH, ckpt_id)`.
Changed: transformers' `BertForPreTraining` (tiny, dropout 0) instead of the `turing` package, synthetic
batches instead of the Wikipedia/BookCorpus shards, gloo instead of nccl; the run trains an epoch, saves,
resumes into a fresh engine and trains another.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForPreTraining

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
logger = importlib.import_module(f"{deepspeed.__name__}.utils.logging").logger


class BertMultiTask:
    """The upstream wrapper: the network lives in `.network`, which `initialize` replaces by the engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        config = BertConfig(
            vocab_size=256,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=args.max_seq_length,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        torch.manual_seed(args.seed)
        self.network = BertForPreTraining(config)

    def set_device(self, device: torch.device) -> None:
        self.device = device

    def train(self) -> None:
        self.network.train()


def synthetic_batches(args: argparse.Namespace, count: int, offset: int) -> list[tuple[torch.Tensor, ...]]:
    """Per-rank batches: (input_ids, token_type_ids, attention_mask, masked_lm_labels, next_sentence_labels)."""
    batches = []
    for index in range(offset, offset + count):
        generator = torch.Generator().manual_seed(1000 * index + dist.get_rank())
        shape = (args.train_micro_batch_size_per_gpu, args.max_seq_length)
        input_ids = torch.randint(5, 256, shape, generator=generator)
        labels = torch.where(torch.rand(shape, generator=generator) < 0.15, input_ids, torch.full(shape, -100))
        next_sentence = torch.randint(0, 2, (shape[0],), generator=generator)
        batches.append((input_ids, torch.zeros_like(input_ids), torch.ones_like(input_ids), labels, next_sentence))
    return batches


def forward_loss(network, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    input_ids, token_type_ids, attention_mask, labels, next_sentence = batch
    out = network(
        input_ids=input_ids,
        token_type_ids=token_type_ids,
        attention_mask=attention_mask,
        labels=labels,
        next_sentence_label=next_sentence,
    )
    return out.loss


def checkpoint_model(PATH: str, ckpt_id: str, model: BertMultiTask, epoch: int, last_global_step: int) -> None:
    checkpoint_state_dict = {"epoch": epoch, "last_global_step": last_global_step}
    success = model.network.save_checkpoint(PATH, ckpt_id, checkpoint_state_dict)
    if not success:
        logger.warning(f"checkpointing failed: PATH={PATH}, ckpt_id={ckpt_id}")


def load_training_checkpoint(model: BertMultiTask, PATH: str, ckpt_id: str) -> tuple[int, int]:
    _, checkpoint_state_dict = model.network.load_checkpoint(PATH, ckpt_id)
    return checkpoint_state_dict["epoch"], checkpoint_state_dict["last_global_step"]


def train(args: argparse.Namespace, index: int, model: BertMultiTask, global_step: int) -> tuple[int, list[float]]:
    model.train()
    losses = []
    micro_steps = args.steps_per_epoch * args.gradient_accumulation_steps
    for batch in synthetic_batches(args, micro_steps, offset=index * micro_steps):
        batch = tuple(t.to(args.device) for t in batch)
        loss = forward_loss(model.network, batch)
        losses.append(loss.item())
        model.network.backward(loss)
        if model.network.is_gradient_accumulation_boundary():
            model.network.step()
            global_step += 1
        else:
            model.network.step()
    return global_step, losses


def get_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="bing_bert")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--max_seq_length", type=int, default=16)
    parser.add_argument("--steps_per_epoch", type=int, default=2)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def prepare_optimizer_parameters(args: argparse.Namespace, model: BertMultiTask) -> list:
    with open(args.deepspeed_config, encoding="utf-8") as handle:
        deepspeed_config = json.load(handle)
    param_optimizer = [n for n in model.network.named_parameters() if "pooler" not in n[0]]
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    assert deepspeed_config["optimizer"]["type"] not in ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
    return [
        {
            "params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def prepare_model_optimizer(args: argparse.Namespace) -> tuple[BertMultiTask, object]:
    deepspeed.init_distributed(dist_backend="gloo")
    args.local_rank = int(os.environ["LOCAL_RANK"])
    model = BertMultiTask(args)
    optimizer_grouped_parameters = prepare_optimizer_parameters(args, model)
    model.network, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model.network, model_parameters=optimizer_grouped_parameters
    )
    args.train_micro_batch_size_per_gpu = model.network.train_micro_batch_size_per_gpu()
    args.gradient_accumulation_steps = model.network.gradient_accumulation_steps()
    args.local_rank = model.network.local_rank
    args.device = model.network.device
    model.set_device(args.device)
    args.fp16 = model.network.fp16_enabled()
    # upstream also compares with ONEBIT_LAMB_OPTIMIZER, which DeepSpeed 0.19.8 no longer defines
    args.use_lamb = model.network.optimizer_name() == deepspeed.runtime.config.LAMB_OPTIMIZER
    return model, optimizer


def main() -> None:
    args = get_arguments()
    model, _ = prepare_model_optimizer(args)
    global_step, losses = train(args, 0, model, global_step=0)
    checkpoint_model(args.output_dir, "epoch0", model, epoch=0, last_global_step=global_step)
    dist.barrier()

    resumed, _ = prepare_model_optimizer(args)
    epoch, global_step = load_training_checkpoint(resumed, args.output_dir, "epoch0")
    global_step, more = train(args, epoch + 1, resumed, global_step)
    if dist.get_rank() == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": losses + more, "global_step": global_step}), flush=True)


if __name__ == "__main__":
    main()
