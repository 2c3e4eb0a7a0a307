"""The one-GPU ZeRO-Offload / ZeRO-Infinity headline (issue 13 item 3): the largest Llama-shaped model that trains
on one GPU with each placement of the model states, and its speed.

    python -m benchmarks.gpu_offload --try a:18,16,14 b:=a fsdp2:=a c:32,28 d:12,8 --json gpu_offload.json

Rows: (a) ZeRO-3 with everything in GPU memory, (b) the optimizer (fp32 master weights, Adam moments, fp32
gradients) offloaded to the CPU, (c) optimizer and parameters on the CPU, (d) both on NVMe (ZeRO-Infinity; swap
files under --nvme-path), and `fsdp2`: plain PyTorch FSDP2 (`fully_shard` per decoder layer, bf16 compute with fp32
reduction, `CPUOffloadPolicy`, torch's AdamW on the host), `b+`/`c+`: rows (b)/(c) with `--ratio` of the optimizer
state on the CPU and the rest on the GPU (DeepSpeed's ZeRO-Offload++ `offload_optimizer.ratio`, split by sub-groups of
`--sub-group-size`), `so`: row (b) with `super_offload` (DeepSpeed's SuperOffload: each sub-group of
`--sub-group-size` stepped on the host during backward), which needs no gradient clipping, so it compares with `a0`,
row (a) without clipping, and `ds`: DeepSpeed's ZeRO-Offload with row (b)'s config
(needs DeepSpeed installed; its CPU Adam is JIT-built on first use). `ROW:L1,L2,...` tries each depth (decoder
layers of a Llama-2-7B-wide model: hidden 4096, 32 heads, MLP 11008, 32k vocabulary, untied head; 32 layers are
Llama-2-7B's 6.74B parameters) in order and stops at the first that trains: list them largest first and the row
reports the largest that fits; `ROW:=a` takes the depth row a trained at. Each try is a fresh process (world size
1), so a failure (CUDA out of memory, the kernel's OOM killer, a full disk) costs only that try and is reported with
its cause.

Every try: bf16, activation checkpointing (Hugging Face `gradient_checkpointing_enable`, non-reentrant), AdamW (lr
1e-4), gradient clipping 1.0 (0 in rows a0 and so), micro-batch --micro x --seq tokens of the bundled byte corpus (a
new batch each step), --steps steps of which the first --warmup are not timed. Reported: parameters, seconds per
step (mean of the timed steps), tokens/s, achieved TFLOPS as 6 * parameters * tokens/s (the issue's definition:
recomputation and attention not counted), the loss of every step, peak GPU memory (`max_memory_allocated`), the
process's peak RSS (VmHWM from /proc) and the swap files' size. Needs CUDA; on a CPU-only machine `--device cpu`
runs the same code as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = {
    "a": "ZeRO-3, all states in GPU memory",
    "b": "ZeRO-3, optimizer offloaded to CPU",
    "c": "ZeRO-3, optimizer + parameters offloaded to CPU",
    "d": "ZeRO-Infinity: optimizer + parameters on NVMe",
    "b+": "ZeRO-3, --ratio of the optimizer on CPU, the rest on the GPU (ZeRO-Offload++)",
    "c+": "ZeRO-3, parameters + --ratio of the optimizer on CPU, the rest on the GPU",
    "a0": "ZeRO-3, all states in GPU memory, no gradient clipping",
    "so": "ZeRO-3, optimizer on CPU stepped during backward (super_offload), no gradient clipping",
    "fsdp2": "PyTorch FSDP2, CPUOffloadPolicy",
    "ds": "DeepSpeed ZeRO-3, optimizer offloaded to CPU (DeepSpeedCPUAdam)",
}


def llama_config(layers: int, hidden: int, seq: int) -> Any:
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    inter = 11008 if hidden == 4096 else 256 * ((8 * hidden // 3 + 255) // 256)
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=32000,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )


def count_parameters(args: argparse.Namespace) -> int:
    """The model's parameters, counted on a meta-device copy (stage 3 leaves placeholders in the module)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(args.layers, args.hidden, args.seq))
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def zero_config(row: str, args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    if row in ("b", "c", "b+", "c+", "so"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if row == "so":  # [Note: speculative host steps]: a sub-group is stepped once complete, so make them many
        zero["offload_optimizer"]["super_offload"] = True
        zero["sub_group_size"] = args.sub_group_size
    if row in ("b+", "c+"):  # [Note: partial offload]: the split is by sub-group, so make them many
        zero["offload_optimizer"]["ratio"] = args.ratio
        zero["sub_group_size"] = args.sub_group_size
    if row in ("c", "c+"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if row == "d":
        nvme = {"device": "nvme", "nvme_path": str(args.nvme_path), "pin_memory": True}
        zero["offload_optimizer"] = dict(nvme)
        zero["offload_param"] = dict(nvme)
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0 if row in ("a0", "so") else 1.0,  # super_offload speculates only without it
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _vmhwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _batches(args: argparse.Namespace):
    import torch

    from zeroshard.data import stdlib_corpus

    tokens = torch.frombuffer(bytearray(stdlib_corpus(4_000_000)), dtype=torch.uint8).long()
    per_step = args.micro * args.seq
    for step in range(args.steps):
        start = (step * per_step) % (len(tokens) - per_step)
        yield tokens[start : start + per_step].view(args.micro, args.seq)


def _engine_step(engine: Any):
    """One training step of a zeroshard or DeepSpeed engine (the same API) on a batch of token ids."""

    def step(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step


def _zeroshard_row(row: str, args: argparse.Namespace, device: Any):
    from transformers import AutoModelForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        model = AutoModelForCausalLM.from_config(llama_config(args.layers, args.hidden, args.seq))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = zeroshard.initialize(model=model, config=zero_config(row, args))

    return engine.module, _engine_step(engine)


def _deepspeed_row(args: argparse.Namespace, device: Any):
    """DeepSpeed's ZeRO-Offload on the same model and config as row (b): `deepspeed.zero.Init` construction, its
    CPU Adam (JIT-built on first use), the same step."""
    import deepspeed
    import torch._dynamo  # noqa: F401 - imported inside zero.Init (by transformers) it trips on DeepSpeed's patches
    from transformers import AutoModelForCausalLM

    config = zero_config("b", args)
    AutoModelForCausalLM.from_config(llama_config(1, 64, 8))  # the model code's lazy imports, outside zero.Init
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(llama_config(args.layers, args.hidden, args.seq))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    return engine.module, _engine_step(engine)


def _fsdp2_row(args: argparse.Namespace, device: Any):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    config = llama_config(args.layers, args.hidden, args.seq)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
    }
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu")  # the fp32 shards live on the host (CPUOffloadPolicy)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.fill_(1.0) if local.dim() == 1 else local.normal_(0.0, config.initializer_range)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config).to(device)  # buffers are not FSDP's: rebuild them on the GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return model, step


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    started = time.perf_counter()
    if args.row == "fsdp2":
        module, step = _fsdp2_row(args, device)
    elif args.row == "ds":
        module, step = _deepspeed_row(args, device)
    else:
        module, step = _zeroshard_row(args.row, args, device)
    params = count_parameters(args)
    init_s = time.perf_counter() - started
    losses, times = [], []
    for x in _batches(args):
        start = time.perf_counter()
        loss = step(x.to(device))
        losses.append(float(loss))  # syncs the device
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[args.warmup :] or times
    step_s = sum(timed) / len(timed)
    tokens_s = args.micro * args.seq / step_s
    return {
        "params": params,
        "init_s": init_s,
        "step_s": step_s,
        "step_times": times,
        "tokens_per_s": tokens_s,
        "tflops": 6 * params * tokens_s / 1e12,
        "losses": losses,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
        "vmhwm_bytes": _vmhwm(),
        "nvme_bytes": sum(f.stat().st_size for f in Path(args.nvme_path).rglob("*") if f.is_file())
        if args.row == "d"
        else 0,
    }


def _cause(returncode: int, log: str) -> str:
    """One line on why a try failed."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (host memory: the kernel's OOM killer)" if name == "SIGKILL" else "")
    for needle, cause in (
        ("OutOfMemoryError", "CUDA out of memory"),
        ("CUDA out of memory", "CUDA out of memory"),
        ("No space left", "disk full"),
        ("MemoryError", "host memory"),
    ):
        if needle in log:
            return cause
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit {returncode}"


def attempt(row: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One try in a fresh process: the child's result, or its failure's cause."""
    with tempfile.TemporaryDirectory(prefix="zeroshard-headline-") as scratch:
        result_path = Path(scratch) / "result.json"
        nvme = Path(args.nvme_path) / f"{row}{layers}"
        command = [sys.executable, "-m", "benchmarks.gpu_offload", "--child", row, "--layers", str(layers)]
        command += ["--result", str(result_path), "--nvme-path", str(nvme)]
        for key in ("hidden", "seq", "micro", "steps", "warmup", "device", "ratio", "sub_group_size"):
            command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        nvme.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            returncode, log = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            returncode, log = -signal.SIGALRM, f"timed out after {args.timeout} s\n{exc.stderr or ''}"
        finally:
            subprocess.run(["rm", "-rf", str(nvme)], check=False)
        out: dict[str, Any] = {"row": row, "layers": layers, "wall_s": time.perf_counter() - started}
        if returncode == 0 and result_path.exists():
            out.update(json.loads(result_path.read_text()), ok=True)
        else:
            cause = f"timed out after {args.timeout} s" if returncode == -signal.SIGALRM else _cause(returncode, log)
            out.update(ok=False, cause=cause, log_tail=log[-3000:])
        return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def table(tries: list[dict[str, Any]]) -> str:
    lines = [
        "| row | layers | parameters | result | s/step | tokens/s | TFLOPS | loss first -> last | GPU peak GiB "
        "| VmHWM GiB | NVMe GiB |",
        "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for t in tries:
        head = f"| {t['row']} {ROWS[t['row']]} | {t['layers']} |"
        if not t["ok"]:
            lines.append(f"{head} | failed: {t['cause']} | | | | | | | |")
            continue
        loss = f"{t['losses'][0]:.3f} -> {t['losses'][-1]:.3f}"
        lines.append(
            f"{head} {t['params'] / 1e9:.2f}B | trains | {t['step_s']:.2f} | {t['tokens_per_s']:.0f} | "
            f"{t['tflops']:.1f} | {loss} | {_gib(t['gpu_peak_bytes'])} | {_gib(t['vmhwm_bytes'])} | "
            f"{_gib(t['nvme_bytes'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--try", dest="tries", nargs="+", default=["a:18,16,14", "b:=a", "fsdp2:=a", "c:32,28"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ratio", type=float, default=0.5, help="rows b+/c+: offload_optimizer.ratio")
    parser.add_argument("--sub-group-size", type=int, default=100_000_000, help="rows b+/c+/so: sub_group_size")
    parser.add_argument("--nvme-path", type=Path, default=Path(tempfile.gettempdir()) / "zeroshard-nvme")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per try")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=sorted(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.row = args.child
        args.result.write_text(json.dumps(child(args)))
        return
    from benchmarks.machine import describe

    rows = []
    settings = {k: getattr(args, k) for k in ("hidden", "seq", "micro", "steps", "warmup", "ratio", "sub_group_size")}
    machine = describe()
    for spec in args.tries:
        row, _, depths = spec.partition(":")
        if row not in ROWS or not depths:
            parser.error(f"--try {spec!r}: expected ROW:L1,L2,... with ROW one of {', '.join(ROWS)}")
        fitted = {t["row"]: t["layers"] for t in rows if t["ok"]}
        for depth in depths.split(","):  # "=a": the depth row a trained at (the issue compares (b) there)
            layers = fitted.get(depth[1:], 0) if depth.startswith("=") else int(depth)
            if not layers:
                continue
            result = attempt(row, layers, args)
            rows.append(result)
            print(table([result]).splitlines()[-1], flush=True)
            report = {"machine": machine, "settings": settings, "tries": rows}
            if args.json:  # after every try: a call cut short by its bound keeps what finished
                args.json.write_text(json.dumps(report, indent=1, default=str))
            if result["ok"]:
                break
    report = {"machine": machine, "settings": settings, "tries": rows}
    print(f"\nmachine: {report['machine']}\nsettings: {settings}\n\n{table(rows)}")


if __name__ == "__main__":
    main()
