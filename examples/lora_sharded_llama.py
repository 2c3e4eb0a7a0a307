"""LoRA on a Llama whose frozen base weights are split over the ranks (DeepSpeed's `deepspeed.linear`), with zeroshard.

torchrun --nproc_per_node 2 examples/lora_sharded_llama.py    # each rank keeps half of every base weight
python examples/lora_sharded_llama.py --steps 10               # one process (whole base weights)

Inside `linear.Init` every `nn.Linear` the model's code builds is a `LoRAOptimizedLinear`: each rank allocates only its
shard of the base weight, the layer gathers it for each use, and only the adapters train (ZeRO-2 shards their
optimizer state). With a checkpoint folder, `linear.Init` around `AutoModelForCausalLM.from_pretrained(folder)` reads
each rank's rows of the base weights from the safetensors files instead.
"""

import argparse

import torch
import transformers

import zeroshard
from zeroshard.data import ByteBlocks, stdlib_corpus
from zeroshard.linear import Init, LoRAConfig

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--save", default=None, help="folder for the adapters' checkpoint and the whole 16-bit model")
args = parser.parse_args()

zeroshard.init_distributed()  # the layers need the group to know their shard
world = torch.distributed.get_world_size()
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
with Init(lora_config=LoRAConfig(lora_r=8, lora_alpha=16, base_weight_sharding=world)):
    model = transformers.AutoModelForCausalLM.from_config(config)  # adapters built, everything else frozen
ds_config = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
}
engine, _, loader, _ = zeroshard.initialize(
    model=model, model_parameters=model.parameters(), training_data=ByteBlocks(stdlib_corpus(200_000), 64),
    config=ds_config,
)  # fmt: skip
step = 0
while step < args.steps:
    for x, _ in loader:  # (transformers shifts the labels itself)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        step += 1
        if engine.global_rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
        if step == args.steps:
            break
if args.save:
    engine.save_checkpoint(args.save, exclude_frozen_parameters=True)  # the adapters; the base comes from its files
    engine.save_16bit_model(args.save, "model.safetensors")  # whole base weights and adapters, loadable again
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
kept = sum(p.numel() for p in model.parameters() if not p.requires_grad)
if engine.global_rank == 0:
    print(f"{trainable} trainable parameters; {kept} frozen ones held on this rank")
