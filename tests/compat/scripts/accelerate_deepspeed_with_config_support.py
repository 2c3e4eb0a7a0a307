"""Causal-LM fine-tuning through Accelerate's DeepSpeed integration: checkpoints, best-model reload, export, resume.

Re-created (trimmed, rewritten) from accelerate `examples/by_feature/deepspeed_with_config_support.py`, commit
08e80c3b870158b128c8e274a1b44c22e7e06579. Kept as upstream: the ds_config reaches the script as
`accelerate launch --config_file` passes it (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, set by
the test); `Accelerator(gradient_accumulation_steps=)`; `DummyOptim` / `DummyScheduler` when the config has an
optimizer / scheduler block, else AdamW over two parameter groups and `get_scheduler("linear")`;
`accelerator.prepare(model, optimizer, train_dl, eval_dl, lr_scheduler)`; the `accumulate` loop with
`backward`, `optimizer.step()`, `lr_scheduler.step()`, `optimizer.zero_grad()`; `save_state` every
`checkpointing_steps`; evaluation through `gather_for_metrics`; `save_state(best_checkpoint)`, `load_state` of it
and the same perplexity again; `unwrap_model(model).save_pretrained(state_dict=accelerator.get_state_dict(model))`.
Changed: a 2-layer GPT-2 from a config and synthetic token blocks (no hub), no shuffling, dropout 0, one epoch of
`--max_train_steps`; a checkpoint is saved once when its step completes (upstream saves at every micro-step while
`completed_steps` stays a multiple); the resume (upstream: a second run with --resume_from_checkpoint) runs in the
same process: `load_state("step_2")`, `skip_first_batches` of the micro-batches already taken (upstream skips
`resume_step` batches, too few with accumulation), the remaining steps trained again; the exported
model.safetensors is loaded into a fresh model and evaluated.
The library is a switch: COMPAT_LIB=deepspeed imports accelerate's Accelerator, COMPAT_LIB=zeroshard
zeroshard.hf's (the only line that differs).
"""

import argparse
import json
import math
import os

import torch

if os.environ.get("COMPAT_LIB", "deepspeed") == "zeroshard":
    from zeroshard.hf import Accelerator
else:
    from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, set_seed  # noqa: E402 (after Accelerator, as upstream)
from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler  # noqa: E402

VOCAB = 256
BLOCK = 32


def blocks(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, BLOCK), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def evaluate(args, model, eval_dataloader, accelerator) -> tuple[float, float]:
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(args.per_device_eval_batch_size)))
    eval_loss = torch.mean(torch.cat(losses))
    return math.exp(eval_loss), eval_loss.item()


def train(args, accelerator, model, optimizer, lr_scheduler, train_dataloader, completed_steps: int) -> tuple:
    """The losses of each micro-batch (mean over ranks), and after each step the lr the scheduler set next."""
    losses, lrs = [], []
    model.train()
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                lrs.append(lr_scheduler.get_last_lr()[0])
                if completed_steps % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        losses.append(accelerator.reduce(loss.detach().clone(), "mean").item())
        if completed_steps >= args.max_train_steps:
            break
    return losses, lrs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=4)
    parser.add_argument("--checkpointing_steps", type=int, default=2)
    # not upstream: start from a saved folder (upstream's --model_name_or_path), built under zeroshard.zero_init()
    parser.add_argument("--model_name_or_path", default=None)
    parser.add_argument("--zero_init", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(42)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=BLOCK,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    if args.model_name_or_path is None:
        model = GPT2LMHeadModel(config)
    elif args.zero_init:
        import zeroshard

        with zeroshard.zero_init():
            model = GPT2LMHeadModel.from_pretrained(args.model_name_or_path)
    else:
        model = GPT2LMHeadModel.from_pretrained(args.model_name_or_path)
    train_dataloader = DataLoader(
        blocks(48, 0), collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        blocks(8, 1), collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )

    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    plugin = accelerator.state.deepspeed_plugin
    optimizer_cls = torch.optim.AdamW if plugin is None or "optimizer" not in plugin.deepspeed_config else DummyOptim
    optimizer = optimizer_cls(groups, lr=args.learning_rate)
    if plugin is None or "scheduler" not in plugin.deepspeed_config:
        lr_scheduler = get_scheduler(
            name="linear",
            optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps,
            num_training_steps=args.max_train_steps,
        )
    else:
        lr_scheduler = DummyScheduler(
            optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=args.num_warmup_steps
        )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    losses, lrs = train(args, accelerator, model, optimizer, lr_scheduler, train_dataloader, 0)
    perplexity, eval_loss = evaluate(args, model, eval_dataloader, accelerator)
    best = os.path.join(args.output_dir, "best_checkpoint")
    accelerator.save_state(best)
    accelerator.wait_for_everyone()  # without DeepSpeed only the main process writes
    accelerator.load_state(best)
    again, _ = evaluate(args, model, eval_dataloader, accelerator)
    if again != perplexity:
        raise AssertionError(f"Best metric {perplexity} does not match the metric {again} of the loaded best model.")

    final = os.path.join(args.output_dir, "final")
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    unwrapped_model.save_pretrained(
        final,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    accelerator.wait_for_everyone()
    exported = GPT2LMHeadModel(config).eval()  # not from_pretrained: under DeepSpeed's ZeRO-3 that partitions it
    missing, unexpected = exported.load_state_dict(load_file(os.path.join(final, "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to wte
    with torch.no_grad():
        exported_loss = exported(
            **next(iter(DataLoader(blocks(8, 1), collate_fn=default_data_collator, batch_size=8)))
        ).loss

    resume_step = 2
    accelerator.wait_for_everyone()
    accelerator.load_state(os.path.join(args.output_dir, f"step_{resume_step}"))
    skipped = accelerator.skip_first_batches(
        train_dataloader, num_batches=resume_step * args.gradient_accumulation_steps
    )
    resumed, resumed_lrs = train(args, accelerator, model, optimizer, lr_scheduler, skipped, resume_step)
    if accelerator.is_main_process:
        result = {
            "losses": {
                "train": losses,
                "resumed": resumed,
                "lr": lrs,
                "resumed_lr": resumed_lrs,
                "eval": [eval_loss],
                "exported": [exported_loss.item()],
            }
        }
        print("COMPAT_RESULT " + json.dumps(result), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
