"""ZeRO-3 beyond parity: memory and communication against the formulas, gathering APIs, LoRA,
divergence detection and sharded construction."""

from __future__ import annotations

import os

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _memory_and_comm(rank: int, world_size: int):
    import zeroshard

    case = Case(stage=3, dtype="bf16", steps=3, prefetch=6000)
    model = build_model(case)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=ds_config(case)
    )
    per_step = []
    for batch in global_batches(case, world_size):
        before = engine.comm_stats.snapshot()
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        engine.backward(engine(x, y))
        after_backward = engine.memory_report()
        engine.step()
        after = engine.comm_stats.snapshot()
        per_step.append({k: after[k]["bus_bytes"] - before[k]["bus_bytes"] for k in after})
    report = engine.memory_report()
    units = engine.strategy.units
    largest_unit = max(u.numel for u in units if u.name)
    root_unit = sum(u.numel for u in units if u.name == "")
    assert len(units) == 3, [u.name for u in units]  # the root and two blocks
    # between steps the freed gradient shards read as zeros ([Note: gradient shards exist from reduction to step]):
    # a full gradient, and a step whose window had no backward
    freed = all(u.grad_shard.untyped_storage().nbytes() == 0 for u in units)
    zeros = float(engine.strategy.full_grad(next(engine.module.parameters())).abs().sum()) == 0.0
    empty_step = engine.strategy.step()
    freed = freed and all(u.grad_shard.untyped_storage().nbytes() == 0 for u in units)
    assert freed and zeros and empty_step.grad_norm == 0.0, (freed, zeros, empty_step)
    engine.destroy()
    return report, after_backward, per_step, largest_unit + root_unit, case.prefetch


def test_stage3_memory_and_communication():
    world_size = 2
    for report, after_backward, per_step, largest_unit, prefetch in run_on_ranks(_memory_and_comm, world_size):
        psi = report.trainable_numel
        # ZeRO's 16 bytes per parameter hold from backward to the step: the gradient shards are freed after it
        # ([Note: gradient shards exist from reduction to step])
        b = after_backward
        states = b.params + b.gradients + b.master_weights + b.optimizer_state
        assert abs(states - 16 * psi / world_size) <= 0.05 * 16 * psi / world_size, (states, psi)
        assert report.gradients == 0 and report.model_states == b.model_states - b.gradients, (report, b)
        # the working set never exceeded the root unit (gathered by its modules: embeddings, final norm, head), the
        # block in use and the prefetch bucket (reuse distance 0: nothing is kept for later)
        bf16_bytes = 2
        assert report.peak_gathered_params <= bf16_bytes * (largest_unit + prefetch), report
        frac = (world_size - 1) / world_size
        # bf16: 2 bytes; all-gather twice (forward, backward), the root unit three times (its embeddings, its final
        # norm and head, their backward: [Note: root unit by module]), reduce-scatter once
        for step in per_step:
            assert abs(step["all_gather"] - 2 * psi * 2 * frac) <= 0.10 * 2 * psi * 2 * frac, step
            assert abs(step["reduce_scatter"] - psi * 2 * frac) <= 0.10 * psi * 2 * frac, step


def _gathering_apis(rank: int, world_size: int, out_dir: str):
    import zeroshard

    case = Case(stage=3, steps=2)
    model = build_model(case)
    config = ds_config(case)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    batch = global_batches(case, world_size)[0]
    x, y = micro_batch(batch, 0, rank, world_size, case.micro)
    engine.backward(engine(x, y))
    engine.step()
    released_shape = tuple(engine.module.blocks[0].mlp[0].weight.shape)
    state = engine.module.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    # GatheredParameters: rank 0 changes a weight; every rank sees it afterwards, also in the shards
    target = engine.module.blocks[1].attn.proj.weight
    # fwd_module (PEFT's gather_params_ctx passes it): a module that owns the parameter needs no hint
    with zeroshard.GatheredParameters(target, modifier_rank=0, fwd_module=engine.module.blocks[1]):
        if rank == 0:
            with torch.no_grad():
                target.fill_(0.5)
    try:  # one that does not own it would compute with a placeholder: refused before anything is gathered
        zeroshard.GatheredParameters(target, fwd_module=engine.module.blocks[0])
        external = ""
    except NotImplementedError as e:
        external = str(e)
    after = engine.module.state_dict()["blocks.1.attn.proj.weight"]
    # generation-style forwards inside gathered_for_generation communicate nothing
    with engine.gathered_for_generation(), torch.no_grad():
        before = engine.comm_stats.total_bus_bytes
        engine(x, y)
        engine(x, y)
        generation_bytes = engine.comm_stats.total_bus_bytes - before
    schedule = engine.strategy.schedule
    schedule.peak_gathered_numel = 0
    engine.save_16bit_model(out_dir, "model.safetensors")
    units = [u.numel for u in engine.strategy.units if not u.persistent]
    one_at_a_time = 0 < schedule.peak_gathered_numel <= max(units) < sum(units)  # (it gathered all at once)
    final = engine.module.state_dict()
    engine.destroy()
    return released_shape, shapes, bool((after == 0.5).all()) and external, generation_bytes, final, one_at_a_time


def test_stage3_state_dict_gathered_parameters_and_save(tmp_path):
    from safetensors.torch import load_file

    results = run_on_ranks(_gathering_apis, 2, str(tmp_path))
    reference = build_model(Case(stage=3))
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    for released_shape, shapes, modified, generation_bytes, _, one_at_a_time in results:
        assert one_at_a_time, "save_16bit_model gathers one unit at a time"
        assert released_shape == (0,), "a released parameter is an empty placeholder"
        assert shapes == expected, "state_dict must hold full tensors"
        assert modified and "register_external_parameter" in modified, "GatheredParameters(modifier_rank=0) change lost"
        assert generation_bytes == 0
    saved = load_file(str(tmp_path / "model.safetensors"))
    state = results[0][4]
    assert set(saved) == set(state), set(state) ^ set(saved)  # every name, a tied weight's too
    for name, tensor in saved.items():
        assert torch.equal(tensor, state[name]), name


def _tiny_llama_lora(rank: int, world_size: int, out_dir: str):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroshard

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    adapter = get_peft_model_state_dict(engine.module)  # every rank: state_dict gathers
    trainable = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    with zeroshard.GatheredParameters(list(trainable.values())):
        gathered = {n: p.detach().clone() for n, p in trainable.items()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(out_dir, "adapter.safetensors"))
    engine.destroy()
    return losses, {k: tuple(v.shape) for k, v in adapter.items()}, gathered


def test_stage3_peft_lora(tmp_path):
    from safetensors.torch import load_file

    results = run_on_ranks(_tiny_llama_lora, 2, str(tmp_path))
    losses, shapes, gathered = results[0]
    assert shapes and all(len(s) == 2 and min(s) > 0 for s in shapes.values()), shapes
    saved = load_file(str(tmp_path / "adapter.safetensors"))
    assert len(saved) == len(gathered) == 8  # q_proj, v_proj x lora_A, lora_B x 2 layers
    for name, tensor in saved.items():
        match = [
            v for n, v in gathered.items() if n.replace(".default", "").endswith(name.split("base_model.model.")[-1])
        ]
        assert match and torch.equal(match[0], tensor), name
    assert any(float(t.abs().sum()) > 0 for n, t in saved.items() if "lora_B" in n), "lora_B never trained"


def _diverge(rank: int, world_size: int, skip_from: int = 0):
    os.environ["ZEROSHARD_DIVERGENCE_TIMEOUT_S"] = "10"
    import time

    import zeroshard
    from helpers.parity import TINY, VariantGPT

    case = Case(stage=3, steps=3)
    torch.manual_seed(0)
    model = VariantGPT(TINY, "order")
    engine, _, _, _ = zeroshard.initialize(model=model, config=ds_config(case))
    start, applied = time.time(), 0
    try:
        for step, batch in enumerate(global_batches(case, world_size)):
            if rank == 1 and step == skip_from:  # rank 1 stops calling the second block: collectives differ
                model.forward = lambda idx, targets=None: _forward_skipping(model, idx, targets)  # type: ignore
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            engine.step()
            applied += 1
    except zeroshard.ZeroshardError as err:
        return type(err).__name__, str(err), time.time() - start, applied
    return None, None, time.time() - start, applied


def _forward_skipping(model, idx, targets):
    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
    x = model.blocks[0](x)  # blocks[1] skipped
    logits = model.lm_head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_divergent_rank_raises_named_error_quickly():
    outcomes = []
    try:
        outcomes = run_on_ranks(_diverge, 2, timeout=90)
    except AssertionError as err:  # one rank raised (the harness reports the first failure)
        pytest.fail(f"a rank crashed instead of raising the divergence error: {err}")
    raised = [o for o in outcomes if o[0]]
    assert raised, outcomes
    name, message, seconds, _ = raised[0]
    assert name == "CollectiveMismatchError" and seconds < 60, raised[0]
    assert "rank 0" in message and "rank 1" in message and "blocks" in message, message


def test_divergence_after_the_first_step_raises_before_the_step_applies():
    """A rank that diverges at a later step (data-dependent control flow) fails with the named error too
    ([Note: divergence check]), and the diverged step's update is applied on no rank."""
    outcomes = run_on_ranks(_diverge, 2, 1, timeout=120)
    assert all(o[0] == "CollectiveMismatchError" for o in outcomes), outcomes
    assert all(o[3] == 1 for o in outcomes), outcomes  # step 0 applied, step 1 refused
    assert all(o[2] < 60 for o in outcomes), outcomes


def _sharded_construction(rank: int, world_size: int):
    import resource

    import zeroshard
    from zeroshard.comm import init_distributed
    from zeroshard.models.gpt import GPT, GPTConfig

    init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 10**6,
        },
    }

    def build_and_step(cfg: GPTConfig) -> tuple[bool, int]:
        torch.manual_seed(0)
        with zeroshard.zero_init():
            model = GPT(cfg)
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        x = torch.randint(0, 256, (1, 16))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        engine.strategy.hooks.remove()  # not destroy(): that would gather the full model on purpose
        return bool(torch.isfinite(loss)), peak

    # warm-up on a tiny model: first-use imports and kernels are not model memory
    build_and_step(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=48, n_head=4, n_embd=256, bias=False)
    full_bytes = 4 * (12 * 256 * 256 * 48 + 256 * 256 + 16 * 256)
    finite, peak = build_and_step(cfg)
    return peak - baseline, full_bytes, finite


@pytest.mark.slow  # default-suite budget: moved 2026-11-25 (seventeenth session)
def test_sharded_construction_stays_below_full_model_size(monkeypatch):
    # A fixed glibc mmap threshold makes RSS follow live tensors: with glibc's default dynamic threshold,
    # freed unit-sized buffers stay in the heap and RSS measures the allocator's cache, not the model.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    for growth, full_bytes, finite in run_on_ranks(_sharded_construction, 4, timeout=300):
        assert finite
        assert growth < full_bytes, (
            f"peak RSS grew by {growth / 2**20:.0f} MiB; the full model is {full_bytes / 2**20:.0f} MiB"
        )


def _consolidated(rank: int, world_size: int):
    import zeroshard

    out = {}
    for stage in (1, 3):
        case = Case(stage=stage, dtype="bf16", steps=2)
        model = build_model(case)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        for batch in global_batches(case, world_size):
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            engine.step()
        full = engine.consolidated_state_dict()
        compute = engine.module.state_dict()
        out[stage] = {
            k: (v.dtype, tuple(v.shape), float((v - compute[k].float()).abs().max())) for k, v in full.items()
        }
        engine.destroy()
    return out


def test_consolidated_state_dict_gives_fp32_masters():
    for result in run_on_ranks(_consolidated, 2):
        for stage, entries in result.items():
            assert "lm_head.weight" in entries and "wte.weight" in entries
            for name, (dtype, shape, diff) in entries.items():
                assert dtype == torch.float32 and len(shape) >= 1, (stage, name)
                assert diff < 1e-2, (stage, name, diff)  # the bf16 compute copy is the master rounded
            assert any(d > 0 for _, _, d in entries.values()), "masters should keep bits bf16 drops"


def _inference_only(rank: int, world_size: int):
    """zero_init + initialize without an optimizer: sharded inference, as DeepSpeed allows at stage 3."""
    import zeroshard
    from helpers.parity import TINY
    from zeroshard.errors import ZeroshardError
    from zeroshard.models.gpt import GPT

    torch.manual_seed(0)
    with zeroshard.zero_init():
        model = GPT(TINY)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=config)
    x = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits = engine(x)
    report = engine.memory_report()
    full = engine.module.state_dict()  # gathered copies
    plain = GPT(TINY)
    plain.load_state_dict(full)
    with torch.no_grad():
        expected = plain(x)
    try:
        engine.step()
        refused = ""
    except ZeroshardError as e:
        refused = str(e)
    full_bytes = sum(v.numel() * v.element_size() for v in full.values())
    return optimizer, float((logits - expected).abs().max()), report.params, full_bytes, refused


def test_zero_init_inference_without_an_optimizer():
    for optimizer, diff, params, full_bytes, refused in run_on_ranks(_inference_only, 2):
        assert optimizer is None and diff == 0.0
        assert params < 0.75 * full_bytes, (params, full_bytes)  # each rank holds shards, not the model
        assert "needs an optimizer" in refused


def _diverge_persistent(rank: int, world_size: int, verify: str):
    """Width-128 blocks: every parameter is below DeepSpeed's default persistence threshold (1e5 elements), so the
    blocks are gathered once and never again: a block skipped on one rank changes no collective."""
    os.environ["ZEROSHARD_VERIFY_COLLECTIVES"] = verify  # gloo's fingerprints, or NCCL's default (off)
    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=128, bias=False))
    if rank == 1:
        model.forward = lambda idx, targets=None: _forward_skipping(model, idx, targets)  # type: ignore[method-assign]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},  # stage3_param_persistence_threshold left at its default
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    persistent_only = [u.name for u in engine.strategy.units] == ["<persistent>"]
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    try:
        engine.backward(engine(x, x))
        engine.step()
    except zeroshard.ZeroshardError as err:
        return persistent_only, type(err).__name__, str(err)
    return persistent_only, None, None


def test_divergence_caught_when_no_collective_differs():
    for verify in ("1", "0"):
        for persistent_only, name, message in run_on_ranks(_diverge_persistent, 2, verify, timeout=120):
            assert persistent_only  # the premise: no block has a unit of its own
            assert name == "CollectiveMismatchError", (verify, name, message)
            assert "2 block forwards" in message and "1 block forwards" in message, message


class _DetachingLinear(torch.nn.Linear):
    """Its own state-dict code gives the parameter's name another tensor (as casting or packing modules do)."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.detach()
        destination[prefix + "bias"] = self.bias.detach()

    def get_extra_state(self):
        return {"step": 3}  # no tensor: safetensors cannot hold it

    def set_extra_state(self, state):
        pass


def _custom_state_dict_save(rank: int, world_size: int, out_dir: str):
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(_DetachingLinear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    whole = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine.save_16bit_model(out_dir, "model.safetensors")
    engine.destroy()
    return whole


def test_save_16bit_model_keeps_what_a_modules_own_state_dict_code_gives(tmp_path):
    """A module whose _save_to_state_dict writes a new tensor under a parameter's name is saved through its own
    code (unit by unit, those were matched by identity and saved as the empty placeholders); extra state that is no
    tensor is left out with a warning (it crashed rank 0 after the others had gathered)."""
    from safetensors.torch import load_file

    whole = run_on_ranks(_custom_state_dict_save, 2, str(tmp_path))[0]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == {"0.weight", "0.bias", "2.weight", "2.bias"}, set(saved)
    for name, tensor in saved.items():
        assert torch.equal(tensor, whole[name]), name
