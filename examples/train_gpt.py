"""Train a small byte-level GPT on the Python standard library's source with zeroshard.

torchrun --nproc_per_node 2 examples/train_gpt.py            # 2 processes, ZeRO-3 (examples/ds_config_zero3.json)
python examples/train_gpt.py --steps 20                        # one process, no launcher
"""

import argparse
import time

import torch

import zeroshard
from zeroshard.data import ByteBlocks, stdlib_corpus
from zeroshard.models.gpt import GPT, PRESETS

parser = argparse.ArgumentParser()
parser.add_argument("--config", default="examples/ds_config_zero3.json")
parser.add_argument("--model", default="small", choices=sorted(PRESETS))
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--corpus-bytes", type=int, default=1_000_000)
args = parser.parse_args()

torch.manual_seed(0)
model = GPT(PRESETS[args.model])
dataset = ByteBlocks(stdlib_corpus(args.corpus_bytes), model.config.block_size)
engine, optimizer, loader, scheduler = zeroshard.initialize(
    model=model, model_parameters=model.parameters(), training_data=dataset, config=args.config
)

rank0 = engine.global_rank == 0
t0, epoch, losses, printed = time.time(), 0, [], 0
while engine.global_steps < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if rank0 and engine.global_steps % 10 == 0 and engine.global_steps != printed:
            printed = engine.global_steps
            tokens = engine.global_steps * engine.train_batch_size() * model.config.block_size
            print(
                f"step {engine.global_steps:4d}  loss {sum(losses[-10:]) / len(losses[-10:]):.4f}  "
                f"lr {engine.get_lr()[0]:.2e}  {tokens / (time.time() - t0):,.0f} tok/s",
                flush=True,
            )
        if engine.global_steps >= args.steps:
            break
    epoch += 1

if rank0:
    report = engine.memory_report()
    print(
        f"done: {engine.global_steps} steps, final loss {sum(losses[-10:]) / len(losses[-10:]):.4f}, {report.summary()}"
    )
engine.destroy()
