"""ALST/Ulysses sequence parallelism through Accelerate's DeepSpeed integration, with a hand-written loss combination.

Re-created (trimmed, rewritten) from accelerate `src/accelerate/test_utils/scripts/external_deps/
test_ds_alst_ulysses_sp.py` (accelerate 1.15.0). Kept as upstream: `ParallelismConfig(sp_backend="deepspeed",
sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=256, sp_seq_length_is_variable=True,
sp_attn_implementation="sdpa"))`, `Accelerator(parallelism_config=)`, 4 samples of 32 tokens
(`arange(1, 129).view(4, 32) + 100`) with position_ids and micro-batch 1, `torch.optim.Adam(lr=1e-5)`,
`accelerator.prepare(model, optimizer, dl)`, the sequence-parallel group from `groups._get_sequence_parallel_group()`,
`move_to_device`, `loss_function(logits, labels=None, shift_labels=...)` and the differentiable token-weighted
all-gather of the parts' losses, `accelerator.backward(loss)`, `optimizer.step()`. Changed: a tiny Llama built from
a config (no hub, no tokenizer), a learning rate of 1e-3 so that the steps move the loss, and rank 0 prints the
losses as one COMPAT_RESULT line. The ds_config comes as `accelerate launch` passes it (set by the test).
The library is a switch: COMPAT_LIB=deepspeed imports accelerate's Accelerator, DeepSpeed's groups and
move_to_device; COMPAT_LIB=zeroshard the same names from zeroshard.
"""

import json
import os

import torch
from accelerate.utils import ParallelismConfig, set_seed
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
from transformers import LlamaConfig, LlamaForCausalLM

if os.environ.get("COMPAT_LIB", "deepspeed") == "zeroshard":
    from zeroshard.hf import Accelerator
    from zeroshard.runtime.utils import move_to_device
    from zeroshard.utils import groups
else:
    from accelerate import Accelerator
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups

set_seed(42)
world_size = 2
micro_batch_size = 1
parallelism_config = ParallelismConfig(
    sp_backend="deepspeed",
    sp_size=world_size,
    sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=256, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
    ),
)
accelerator = Accelerator(parallelism_config=parallelism_config)

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

samples = 4
seqlen = 32
input_ids = torch.arange(1, seqlen * samples + 1).view(-1, seqlen) + 100
position_ids = torch.arange(seqlen * samples).view(-1, seqlen)
ds = torch.utils.data.TensorDataset(input_ids, position_ids)


def collate_fn(batch):
    input_ids, position_ids = batch[0]
    return dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=input_ids.unsqueeze(0))


dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
rank = torch.distributed.get_rank()
model, optimizer, dl = accelerator.prepare(model, optimizer, dl)

sp_size = parallelism_config.sp_size
sp_group = groups._get_sequence_parallel_group()
sp_world_size = parallelism_config.sp_size
unwrapped_model = accelerator.unwrap_model(model)

losses = []
for batch in dl:
    optimizer.zero_grad()
    batch = move_to_device(batch, model.device)
    outputs = model(**batch)
    shift_labels = batch["shift_labels"]
    loss = unwrapped_model.loss_function(
        logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=unwrapped_model.config.vocab_size
    )
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
    good_tokens = (shift_labels != -100).view(-1).sum()
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
    total_loss = sum(
        losses_per_rank[rank] * good_tokens_per_rank[rank]
        for rank in range(sp_world_size)
        if good_tokens_per_rank[rank] > 0
    )
    total_good_tokens = sum(good_tokens_per_rank)
    loss = total_loss / max(total_good_tokens, 1)
    losses.append(loss.item())
    accelerator.backward(loss)
    optimizer.step()

if torch.distributed.get_rank() == 0:
    print("COMPAT_RESULT " + json.dumps({"losses": losses}), flush=True)
accelerator.end_training()
