"""One autotuning trial on one rank (started by torchrun in a fresh process per trial, trial.py).

Builds the Hugging Face model of `model` (weights when the folder has them, else from its config), trains
`end` steps on random tokens with `config`, times steps `start`..`end`, and has rank 0 write the result:
the median step time over ranks' maxima, samples per second, and the peak memory of the worst rank (on CUDA
`max_memory_allocated`; on CPU the peak RSS above the process's RSS before the model was built).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak(baseline: int) -> int:
    import torch

    if torch.cuda.is_available():  # what the allocator took from the device, its cached blocks included: a trial
        return int(torch.cuda.max_memory_reserved())  # under the cap by allocated bytes alone can still run out
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline


def _model(folder: str) -> Any:
    """The model of `--model`: a Hugging Face folder (its weights if it has them), or a built-in config's name (as
    `zeroshard estimate` and `zeroshard train` take it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isdir(folder):
        from zeroshard.presets import model_preset

        return AutoModelForCausalLM.from_config(model_preset(folder).hf_config(vocab_size=259))
    weights = any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))
    if weights:
        return AutoModelForCausalLM.from_pretrained(folder)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def main() -> None:
    """`python -m zeroshard.autotuning.worker JOB.json` (one argument: torchrun's own options would
    swallow look-alike ones); JOB holds model, config, out, seq_len, start, end."""
    with open(sys.argv[1]) as f:
        args = argparse.Namespace(**json.load(f))
    import torch
    import torch.distributed as dist

    import zeroshard

    baseline = _rss()
    torch.manual_seed(0)
    model = _model(args.model).train()
    with open(args.config) as f:
        config = json.load(f)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(engine.global_rank)
    times = []
    for step in range(args.end):
        ids = torch.randint(0, model.config.vocab_size, (micro, args.seq_len), generator=g).to(engine.device)
        zeroshard.accelerator.get_accelerator().synchronize()
        begin = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        zeroshard.accelerator.get_accelerator().synchronize()
        if step >= args.start:
            times.append(time.perf_counter() - begin)
    worst = torch.tensor([float(_peak(baseline))] + times, dtype=torch.float64, device=engine.device)  # NCCL: on it
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    step_s = statistics.median(worst[1:].tolist())
    result = {
        "step_s": step_s,
        "samples_per_s": micro * engine.world_size / step_s,
        "peak_bytes": int(worst[0]),
    }
    if engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    engine.destroy()


if __name__ == "__main__":
    main()
