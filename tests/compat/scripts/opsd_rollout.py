"""On-policy distillation (OPSD) through DeepSpeed's rollout API: the student generates, a frozen teacher scores.

Re-created (rewritten, trimmed to one file) from DeepSpeedExamples' OPSD example (2026, written against DeepSpeed's
`deepspeed.runtime.rollout`; not in the mirror at hand, so no commit is named): `main.py` (seed, student engine,
frozen teacher, `build_rollout(cfg.rollout, student_engine=..., tokenizer=..., student_model_path=...)`, a
`DistributedSampler` over the prompts with `set_epoch` per epoch), `config.py` (the example's `RolloutConfig`, a
dataclass subclass of `deepspeed.runtime.rollout.RolloutConfig` adding max_prompt_length, max_response_length,
temperature, top_p, top_k, n_samples_per_prompt), `trainer.py` (`OPSDTrainer._train_step`: `rollout.sync_weights`,
`engine.eval()`, `rollout.generate(RolloutRequest(...), SamplingConfig(...))`, the response mask, the teacher's
forward into a host cache, `engine.train()`, the student forward, logits shifted by one, the streamed loss,
`engine.backward`, `engine.step`, the loss averaged over ranks, the response-token count), `teacher.py`
(`TeacherWrapper`: the teacher frozen and wrapped by `deepspeed.initialize` at ZeRO-3 with its parameters offloaded
to the CPU, `TeacherLogitCache.chunk_to_device`), `losses.py` (`streamed_distillation_loss`, reverse KL, chunks
with no response token skipped), `utils.py` (`build_response_mask`) and `data.py` (`LeftPaddedPromptCollator`:
truncate to max_prompt_length, left-pad to the longest prompt of the batch).
Kept as upstream: those calls and their order, ZeRO-3 for the student with `"hybrid_engine": {"enabled": true}`
(the example's ds_zero3.json is "ZeRO-3 + hybrid engine"), a Qwen2 student and teacher (the example's Qwen2.5 pair:
DeepSpeed has no inference policy for Qwen2, so its hybrid engine builds no inference containers and the rollout runs
the model's own `generate` with ZeRO-3 gathering, as DeepSpeed's warning says; with a Llama the
hybrid engine's containers need DeepSpeed's inference kernels, which it has not built for the CPU), reverse KL at
temperature 1, the tokenizer's pad id for the padding.
Changed: tiny Qwen2 models built from configs with their own seeds (student 1234, teacher 4321; initializer range
0.1, so that the two disagree and greedy decoding does not settle on one token; no hub download), a stand-in
tokenizer (pad 0; EOS 25, a token the student emits at several points of its greedy responses, so that the rollout
pads after the first EOS), twelve prompts of random ids 1-127 and 3 to 10 tokens, truncated to 8, so that the rows
of a batch carry left padding of different widths; fp32 (DeepSpeed refuses fp16 on CPU) with torch's AdamW at lr
1e-3 (DeepSpeed's FusedAdam needs CUDA); the teacher's logits kept on the host in fp32 rather than bf16 (so that a
last-bit difference in them cannot move the compared loss by a bf16 rounding); sequence chunks of 4, so that the
streamed loss fetches several and skips the prompt's; two epochs of 3 steps on 2 prompts per rank: the first with
greedy rollouts (the example's temperature 0), the second sampled (temperature 1, top_p 0.9, top_k off, 2 samples
per prompt), the global generator reseeded before each sampled rollout from the step and the rank (upstream seeds
once: what a library draws between the seed and the rollout would otherwise move the samples; DeepSpeed's hybrid
engine also copies rank 0's generator state to every rank at initialize).
Added: each rollout's shapes, dtypes, prompt columns and response start are checked, its mask against
`ResponseTokenBatch.from_rollout` (the same mask, shifted by one), and the library's `generalized_jsd_loss` is
evaluated on the step's logits (beta 1 must equal the streamed reverse KL; beta 0.5 is reported). The report, per
step, averaged (losses) or summed (counts) over ranks: the loss, the JSD, the response tokens, the rows that hold
an EOS, position-weighted checksums of the generated ids and of the attention mask.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from transformers import Qwen2Config, Qwen2ForCausalLM

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
rollout_api = importlib.import_module(f"{deepspeed.__name__}.runtime.rollout")
opsd_api = importlib.import_module(f"{deepspeed.__name__}.runtime.rollout.opsd")

SEED = 42
PAD, EOS = 0, 25
MICRO_BATCH = 2
CHUNK = 4
STEPS_PER_EPOCH = 3


@dataclass
class OPSDRolloutConfig(rollout_api.RolloutConfig):
    """The example's rollout settings on top of the library's RolloutConfig (engine "hybrid_engine")."""

    max_prompt_length: int = 8
    max_response_length: int = 10
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1


class StandInTokenizer:
    """What the rollout and the collator read of a tokenizer: its pad and EOS ids."""

    pad_token_id = PAD
    eos_token_id = EOS
    padding_side = "left"


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config)


def student_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 100,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "hybrid_engine": {"enabled": True},
    }


def teacher_config() -> dict:
    """TeacherWrapper's: ZeRO-3 on more than one data-parallel rank, its parameters offloaded (offload_to_cpu)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }


def prompts() -> list[list[int]]:
    """Twelve pre-tokenized prompts of 3 to 10 ids from 1 to 127 (never the pad; the EOS happens not to occur)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(12):
        length = int(torch.randint(3, 11, (1,), generator=generator))
        out.append(torch.randint(1, 128, (length,), generator=generator).tolist())
    return out


def left_padded(batch: list[list[int]], max_prompt_length: int) -> dict[str, torch.Tensor]:
    """LeftPaddedPromptCollator on ids: truncated to max_prompt_length, real tokens at the right edge."""
    rows = [ids[:max_prompt_length] for ids in batch]
    width = max(len(r) for r in rows)
    prompt_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        prompt_ids[i, width - len(row) :] = torch.tensor(row)
        attention[i, width - len(row) :] = 1
    return {"prompt_ids": prompt_ids, "prompt_attention_mask": attention}


def build_response_mask(response_start_idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """1 at the attended positions at or after each row's response start (utils.build_response_mask)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device).unsqueeze(0)
    is_response = positions >= response_start_idx.to(positions.dtype).unsqueeze(1)
    return is_response.to(attention_mask.dtype) * attention_mask


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    per_token = (student_log_probs.exp() * (student_log_probs - teacher_log_probs)).sum(dim=-1)
    return per_token * temperature**2


def streamed_reverse_kl(
    student_logits: torch.Tensor,
    fetch_teacher: Callable[[int, int], torch.Tensor],
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = CHUNK,
) -> torch.Tensor:
    """The mean per-token divergence over response positions, the teacher's logits fetched a chunk at a time."""
    mask = response_mask.to(torch.float32)
    total = student_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, student_logits.shape[1], chunk_size):
        end = min(start + chunk_size, student_logits.shape[1])
        if mask[:, start:end].sum().item() == 0:
            continue
        teacher = fetch_teacher(start, end)
        per_token = reverse_kl(student_logits[:, start:end].float(), teacher.float(), temperature)
        total = total + (per_token * mask[:, start:end]).sum()
    return total / mask.sum().clamp_min(1.0)


class HostLogits:
    """TeacherLogitCache: the teacher's logits parked on the host, handed back a sequence slice at a time."""

    def __init__(self, logits: torch.Tensor, store_dtype: torch.dtype = torch.float32):
        self.cpu_logits = logits.detach().to(dtype=store_dtype).cpu()

    def chunk_to_device(self, start: int, end: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        assert 0 <= start < end <= self.cpu_logits.shape[1], (start, end)
        return self.cpu_logits[:, start:end].to(device=device, dtype=dtype)

    def free(self) -> None:
        self.cpu_logits = torch.empty(0)


class FrozenTeacher:
    def __init__(self, model: torch.nn.Module):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.engine, *_ = deepspeed.initialize(model=model, config=teacher_config())

    @torch.no_grad()
    def forward_to_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> HostLogits:
        return HostLogits(self.engine(input_ids=input_ids, attention_mask=attention_mask).logits)


def summed(values: list[float]) -> list[float]:
    out = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.tolist()


def check_rollout(roll, request, sampling) -> None:
    """What the trainer relies on: prompt columns first, every row's response from the prompt width on."""
    rows = request.prompt_ids.shape[0] * sampling.n_samples_per_prompt
    width = request.prompt_ids.shape[1]
    assert roll.input_ids.shape == (rows, width + sampling.max_new_tokens), roll.input_ids.shape
    assert roll.input_ids.dtype == torch.long and roll.attention_mask.dtype == torch.long
    assert roll.response_start_idx.dtype == torch.long and roll.response_start_idx.tolist() == [width] * rows
    expanded = request.prompt_ids.repeat_interleave(sampling.n_samples_per_prompt, dim=0)
    assert torch.equal(roll.input_ids[:, :width], expanded)
    mask = request.prompt_attention_mask.repeat_interleave(sampling.n_samples_per_prompt, dim=0)
    assert torch.equal(roll.attention_mask[:, :width], mask)


def train_step(engine, teacher, rollout, batch, cfg, step: int, rank: int) -> dict[str, float]:
    rollout.sync_weights(step)
    engine.eval()
    sampling = rollout_api.SamplingConfig(
        max_new_tokens=cfg.max_response_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
    )
    request = rollout_api.RolloutRequest(
        prompt_ids=batch["prompt_ids"], prompt_attention_mask=batch["prompt_attention_mask"]
    )
    if cfg.temperature > 0:
        torch.manual_seed(SEED + 1000 * step + rank)
    roll = rollout.generate(request, sampling)
    check_rollout(roll, request, sampling)
    input_ids, attention_mask = roll.input_ids, roll.attention_mask
    response_mask = build_response_mask(roll.response_start_idx, attention_mask)
    tokens = opsd_api.ResponseTokenBatch.from_rollout(roll)
    assert torch.equal(tokens.response_mask, response_mask[:, 1:].bool()), "ResponseTokenBatch's mask"
    assert torch.equal(tokens.target_ids, input_ids[:, 1:])

    cache = teacher.forward_to_cache(input_ids, attention_mask)

    engine.train()
    logits = engine(input_ids=input_ids, attention_mask=attention_mask).logits
    shifted = logits[:, :-1, :]
    assert torch.equal(tokens.select_causal_logits(logits), shifted)
    mask_shifted = response_mask[:, 1:].contiguous()
    loss = streamed_reverse_kl(
        shifted, lambda start, end: cache.chunk_to_device(start, end, shifted.device, shifted.dtype), mask_shifted
    )
    with torch.no_grad():
        teacher_shifted = cache.cpu_logits[:, :-1, :].to(shifted.device)
        reverse = opsd_api.generalized_jsd_loss(shifted.detach(), teacher_shifted, tokens.response_mask, beta=1.0)
        jsd = opsd_api.generalized_jsd_loss(shifted.detach(), teacher_shifted, tokens.response_mask, beta=0.5)
    assert math.isclose(reverse.loss.item(), loss.item(), rel_tol=1e-5), (reverse.loss.item(), loss.item())
    assert int(jsd.valid_token_count) == int(mask_shifted.sum())
    engine.backward(loss)
    engine.step()
    cache.free()

    response = input_ids[:, roll.response_start_idx[0] :]
    weights = torch.arange(1, input_ids.shape[1] + 1, dtype=torch.long)
    return {
        "loss": loss.item(),
        "jsd": jsd.loss.item(),
        "response_tokens": float(mask_shifted.sum().item()),
        "eos_rows": float((response == EOS).any(dim=1).sum().item()),
        # pad ids the model generated before any EOS: the rollout's attention mask leaves them out
        "pad_holes": float(((response == PAD) & ((response == EOS).cumsum(dim=1) == 0)).sum().item()),
        "ids_checksum": float((input_ids * weights).sum().item()),
        "mask_checksum": float((attention_mask * weights).sum().item()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.parse_args()
    torch.manual_seed(SEED)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = StandInTokenizer()

    student = tiny_qwen2(1234)
    engine, *_ = deepspeed.initialize(model=student, model_parameters=student.parameters(), config=student_config())
    teacher = FrozenTeacher(tiny_qwen2(4321))

    settings = {
        "greedy": OPSDRolloutConfig(),
        "sampled": OPSDRolloutConfig(temperature=1.0, top_p=0.9, top_k=-1, n_samples_per_prompt=2),
    }
    data = prompts()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(
        data,
        batch_size=MICRO_BATCH,
        sampler=sampler,
        collate_fn=lambda b: left_padded(b, settings["greedy"].max_prompt_length),
        drop_last=True,
    )
    result: dict[str, dict[str, list[float]]] = {}
    step = 0
    for epoch, (name, cfg) in enumerate(settings.items()):
        rollout = rollout_api.build_rollout(cfg, student_engine=engine, tokenizer=tokenizer, student_model_path=None)
        sampler.set_epoch(epoch)
        for batch in loader:
            metrics = train_step(engine, teacher, rollout, batch, cfg, step, rank)
            totals = summed(list(metrics.values()))
            for key, total in zip(metrics, totals, strict=True):
                value = total / world if key in ("loss", "jsd") else total
                result.setdefault(key, {}).setdefault(name, []).append(value)
            step += 1
        assert len(result["loss"][name]) == STEPS_PER_EPOCH
        rollout.shutdown()
    if rank == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": result}), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
