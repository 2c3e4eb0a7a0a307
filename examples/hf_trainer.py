"""Train a small byte-level Llama with the Hugging Face Trainer on zeroshard: a transformers script, two lines changed.

zeroshard launch --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json
torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json --max_steps 20
python examples/hf_trainer.py --deepspeed examples/ds_config_hf.json --max_steps 20     # one process

The two changes against the same script under DeepSpeed: the `zeroshard.hf` import below, and the launcher
(`zeroshard launch` or `torchrun` for `deepspeed`). The ds_config's "auto" values come from these arguments.
"""

import sys

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

from zeroshard.data import stdlib_corpus
from zeroshard.hf import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments

defaults = (  # the command line's own flags come after these, so they win
    "--output_dir runs/hf_trainer --per_device_train_batch_size 8 --learning_rate 3e-3 --lr_scheduler_type cosine "
    "--warmup_steps 10 --max_steps 100 --logging_steps 10 --save_steps 50 --eval_strategy steps --eval_steps 50 "
    "--report_to none"
).split()
(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(defaults + sys.argv[1:])


class Blocks(torch.utils.data.Dataset):  # byte tokens in blocks of 128; the model shifts the labels itself
    def __init__(self, data: bytes):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self):
        return len(self.tokens) // 128

    def __getitem__(self, i):
        block = self.tokens[i * 128 : (i + 1) * 128]
        return {"input_ids": block, "labels": block}


corpus = stdlib_corpus(1_000_000)
train, held_out = Blocks(corpus[:-20_000]), Blocks(corpus[-20_000:])


def build_model():  # at ZeRO-3 the Trainer calls this under zeroshard.zero_init(): each rank builds only its shards
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4
    )
    return LlamaForCausalLM(config)


trainer = Trainer(model_init=build_model, args=args, train_dataset=train, eval_dataset=held_out)
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
trainer.save_model()  # a from_pretrained folder in args.output_dir
trainer.log_metrics("eval", trainer.evaluate())

prompt = torch.tensor([list(b"def ")], device=args.device)
tokens = trainer.generate(input_ids=prompt, max_new_tokens=48, do_sample=False)[0]  # every rank: a collective
if trainer.is_world_process_zero():
    print(f"sample: {bytes(tokens.tolist()).decode(errors='replace')!r}")
