"""A Llama (and a Qwen3-MoE) checkpoint streamed into stage-3 shards on 2 ranks: the peak resident memory of each
rank, as the OS counts it (/proc/self/status VmHWM), stays below 0.6x the checkpoint (each rank keeps half of it),
and the logits equal a plain single-process `from_pretrained`. ~50M parameters in the default suite, ~1.5B marked
slow."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.harness import run_on_ranks

pytest.importorskip("transformers")

SMALL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 12}
LARGE = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 28}
# 8 layers of 8 experts (2 per token), ~50M parameters, most of them in the experts
MOE = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
       "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512}  # fmt: skip
SHARD_BYTES = 1 << 30


def write_llama(folder: str, sizes: dict[str, int], shard_bytes: int = SHARD_BYTES) -> int:
    """A sharded fp32 safetensors checkpoint with random weights, written tensor by tensor (the model never exists
    in memory); returns its size in bytes."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False, **sizes)
    return write_random(folder, config, shard_bytes)


def write_qwen3_moe(folder: str, sizes: dict[str, int], shard_bytes: int = SHARD_BYTES) -> int:
    """As `write_llama`, a Qwen3-MoE whose experts are stored apart as its checkpoints store them (the model holds
    them fused: [Note: converted checkpoints in a streaming load])."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False, **sizes)
    return write_random(folder, config, shard_bytes, unfuse=True)


def _stored(key: str, value: torch.Tensor, unfuse: bool) -> list[tuple[str, torch.Tensor]]:
    """transformers' on-disk names: fused experts written one tensor per expert and projection."""
    if unfuse and key.endswith(".experts.gate_up_proj"):
        gate, up = value.chunk(2, dim=1)
        base = key.removesuffix("gate_up_proj")
        return [
            (f"{base}{e}.{n}_proj.weight", t[e]) for e in range(value.shape[0]) for n, t in (("gate", gate), ("up", up))
        ]
    if unfuse and key.endswith(".experts.down_proj"):
        base = key.removesuffix("down_proj")
        return [(f"{base}{e}.down_proj.weight", value[e]) for e in range(value.shape[0])]
    return [(key, value)]


def write_random(folder: str, config: object, shard_bytes: int, unfuse: bool = False) -> int:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for key, tensor in meta.state_dict().items():
        value = torch.randn(tensor.shape, generator=generator) * 0.02
        if key.endswith("norm.weight"):
            value += 1.0
        for name, part in _stored(key, value, unfuse):
            shard[name] = part.contiguous()
        total += value.numel() * 4
        if sum(t.numel() * 4 for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _load(rank: int, world_size: int, folder: str, vocab: int):
    from transformers import AutoModelForCausalLM

    import zeroshard

    with zeroshard.zero_init():  # warm-up: transformers' modelling code is imported on first use (~140 MB)
        AutoModelForCausalLM.from_pretrained(folder)
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: imports and start-up are not the load
        f.write("5")
    before = _status("VmRSS")
    with zeroshard.zero_init():
        model = AutoModelForCausalLM.from_pretrained(folder)
    # one block gathered at a time: the forward then needs shards plus a block, as users configure it to
    zero = {
        "stage": 3,
        "stage3_max_live_parameters": 1,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 1,
    }
    engine, *_ = zeroshard.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    )
    load_peak, absolute = _status("VmHWM") - before, _status("VmHWM")
    with torch.no_grad():
        x = _batch(vocab)
        out = engine(x, labels=x)
    return load_peak, absolute, out.logits, float(out.loss)


def _check(tmp_path, sizes: dict[str, int], shard_bytes: int, compare_logits: bool, write=write_llama) -> None:
    folder = str(tmp_path / "model")
    size = write(folder, sizes, shard_bytes)
    expected = None
    if compare_logits:
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            expected = plain(_batch(sizes["vocab_size"])).logits
        del plain
    for load_peak, absolute, logits, loss in run_on_ranks(_load, 2, folder, sizes["vocab_size"], timeout=900):
        assert load_peak < 0.6 * size, f"loading grew the peak RSS by {load_peak / size:.2f}x the checkpoint ({size})"
        if size > 1 << 30:  # large enough that the process's own start-up (torch, transformers) counts little
            assert absolute < 0.6 * size, f"peak RSS {absolute / size:.2f}x the checkpoint ({size})"
        assert torch.isfinite(torch.tensor(loss))
        if expected is not None:
            torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-5)


def test_50m_checkpoint_streams_into_shards_below_0_6x_its_size_with_plain_logits(tmp_path):
    _check(tmp_path, SMALL, 64 << 20, compare_logits=True)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by streaming memory:
# test_50m_checkpoint_streams_into_shards_below_0_6x_its_size_with_plain_logits
@pytest.mark.slow
def test_50m_moe_checkpoint_with_experts_stored_apart_streams_below_0_6x_its_size(tmp_path):
    """The fused experts are read as runs of the stored ones: no rank builds a fused tensor whole."""
    _check(tmp_path, MOE, 64 << 20, compare_logits=True, write=write_qwen3_moe)


@pytest.mark.slow
def test_1_5b_checkpoint_streams_into_shards_below_0_6x_its_size(tmp_path):
    _check(tmp_path, LARGE, SHARD_BYTES, compare_logits=False)
