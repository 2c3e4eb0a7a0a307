"""`zeroshard.linear` (DeepSpeed's `deepspeed.linear`) in one process: which layer `OptimizedLinear` builds, the
LoRA layer's output and gradients against the same sums written out, its refusals, loading a state dict (targets and
non-targets), the fp8 quantizer's error bound and layout, `QuantizedParameter` copies and pickles, and `Init` with a
Transformers model (`from_config`, and `from_pretrained` from a folder) restoring every name it rebinds."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.linear import (
    Init,
    LoRAConfig,
    LoRAOptimizedLinear,
    OptimizedLinear,
    QuantizationConfig,
    QuantizedLinear,
    QuantizedParameter,
    init_lora,
)
from zeroshard.ops.fp_quantizer import FP_Quantize


def test_optimized_linear_builds_the_layer_its_configs_ask_for() -> None:
    assert type(OptimizedLinear(8, 4)) is nn.Linear
    assert type(OptimizedLinear(128, 4, quantization_config=QuantizationConfig(group_size=128))) is QuantizedLinear
    lora = OptimizedLinear(8, 4, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)
    assert type(lora) is LoRAOptimizedLinear
    with pytest.raises(ValueError, match="Expecting LoRAConfig"):
        OptimizedLinear(8, 4, lora_config={"lora_r": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Expecting QuantizationConfig"):
        OptimizedLinear(8, 4, quantization_config={"q_bits": 8})  # type: ignore[arg-type]


def test_lora_layer_output_and_gradients_are_the_written_out_sums() -> None:
    torch.manual_seed(0)
    layer = LoRAOptimizedLinear(16, 8, lora_config=LoRAConfig(lora_r=4, lora_alpha=8), dtype=torch.float32)
    nn.init.normal_(layer.lora_weight_2.weight)  # B starts at zero: give it values so the adapter path counts
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = layer(x)
    a, b = layer.lora_weight_1.weight, layer.lora_weight_2.weight
    x2 = x.detach().clone().requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    want = F.linear(x2, layer.weight) + 2.0 * F.linear(F.linear(x2, a2), b2)
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(a.grad, a2.grad) and torch.equal(b.grad, b2.grad)
    assert layer.weight.grad is None and not layer.weight.requires_grad
    assert layer.weight.ds_optim_param is True
    assert layer.bias is None  # an attribute Transformers' weight tying reads as a tensor or None


def test_lora_layer_starts_as_its_base_and_freezes_it() -> None:
    layer = LoRAOptimizedLinear(8, 8, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)
    x = torch.randn(4, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight))  # B is zero
    bound = 1 / math.sqrt(8)  # Kaiming-uniform with a=sqrt(5) over fan_in 8: PEFT's and nn.Linear's A
    assert layer.lora_weight_1.weight.abs().max() <= bound


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bias": True}, "bias=True is not supported"),
        ({"lora_config": LoRAConfig(offload_ratio=1.5)}, "offload_ratio=1.5 is not a share"),
        ({"lora_config": LoRAConfig(base_weight_sharding=2)}, "needs torch.distributed initialized"),
        ({"quantization_config": QuantizationConfig(), "dtype": torch.float32}, "bfloat16 only"),
        ({"lora_config": None}, "needs a lora_config"),
    ],
)
def test_lora_layer_refusals(kwargs: dict, message: str) -> None:
    args = {"input_dim": 128, "output_dim": 4, "lora_config": LoRAConfig(lora_r=2)} | kwargs
    with pytest.raises((ValueError, RuntimeError), match=message):
        LoRAOptimizedLinear(**args)


def test_delayed_adapters_are_built_by_init_lora() -> None:
    model = nn.Sequential(
        LoRAOptimizedLinear(8, 8, lora_config=LoRAConfig(lora_r=2, delay_lora_init=True), dtype=torch.float32),
        nn.LayerNorm(8),
    )
    with pytest.raises(RuntimeError, match="init_lora was never called"):
        model(torch.randn(2, 8))
    init_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["0.lora_weight_1.weight", "0.lora_weight_2.weight"]  # the LayerNorm is frozen too


def test_loading_a_state_dict_disables_non_targets_and_loads_targets() -> None:
    config = LoRAConfig(lora_r=2, target_mods=["q_proj"])
    model = nn.ModuleDict(
        {
            "q_proj": LoRAOptimizedLinear(8, 4, lora_config=config, dtype=torch.float32),
            "lm_head": LoRAOptimizedLinear(8, 4, lora_config=config, dtype=torch.float32),
        }
    )
    saved = {"q_proj.weight": torch.randn(4, 8), "lm_head.weight": torch.randn(4, 8)}
    missing, unexpected = model.load_state_dict(saved, strict=False)
    assert unexpected == []
    assert not model["q_proj"].disabled and torch.equal(model["q_proj"].weight, saved["q_proj.weight"])
    assert set(missing) == {f"{n}.lora_weight_{i}.weight" for n in ("q_proj", "lm_head") for i in (1, 2)}
    head = model["lm_head"]
    assert head.disabled and torch.equal(head.weight, saved["lm_head.weight"])
    # its adapters stay, unused, as DeepSpeed's: the model's own state dict still loads strictly
    assert [n for n, _ in head.named_parameters()] == ["weight", "lora_weight_1.weight", "lora_weight_2.weight"]
    model.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(head(x), F.linear(x, saved["lm_head.weight"].to(head.dtype)))


def test_fp8_groups_within_the_format_error_and_in_deepspeed_layout() -> None:
    torch.manual_seed(0)
    x = (torch.randn(4, 256) * torch.logspace(-3, 2, 4)[:, None]).to(torch.bfloat16)
    for (
        mantissa,
        largest,
    ) in ((3, 448.0), (2, 57344.0)):
        quantizer = FP_Quantize(QuantizationConfig(group_size=128, mantissa_bits=mantissa))
        packed = quantizer.quantize(x, q_bits=8, q_mantisa_bits=mantissa)
        assert packed.dtype == torch.uint8 and packed.shape == (8, 128 + 4)
        groups = x.float().reshape(8, 128)
        scale = packed[:, 128:].contiguous().view(torch.float32)
        assert torch.equal(scale.squeeze(1), groups.abs().amax(1) / largest)
        back = quantizer.dequantize(packed, q_bits=8, q_mantisa_bits=mantissa)
        assert back.shape == x.shape and back.dtype == torch.bfloat16
        # half a unit in the last place of the format (relative 2^-(m+1)), the subnormal step near zero, and the
        # bf16 output's own rounding
        step = scale.expand(8, 128).reshape(4, 256) * 2.0 ** (-9 if mantissa == 3 else -16)
        bound = x.float().abs() * (2.0 ** -(mantissa + 1) + 2.0**-8) + step
        assert bool(((back.float() - x.float()).abs() <= bound).all())
        assert torch.equal(back.float().abs().reshape(8, 128).amax(1), groups.abs().amax(1))  # the largest exact


def test_fp8_refusals() -> None:
    quantizer = FP_Quantize(QuantizationConfig(group_size=128))
    with pytest.raises(ValueError, match="q_bits=6, mantissa_bits=2 is not supported"):
        quantizer.quantize(torch.ones(128, dtype=torch.bfloat16), q_bits=6, q_mantisa_bits=2)
    with pytest.raises(ValueError, match="do not split into groups of 128"):
        quantizer.quantize(torch.ones(100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="stochastic_mode"):
        quantizer.quantize(torch.ones(128, dtype=torch.bfloat16), stochastic_mode=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        quantizer.quantize(torch.ones(128))
    with pytest.raises(ValueError, match="inf or nan"):
        quantizer.quantize(torch.tensor([1.0, float("inf")] * 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q_dtype=torch.float8_e4m3fn is not supported"):
        QuantizedParameter(
            torch.ones(128, dtype=torch.bfloat16),
            quantization_config=QuantizationConfig(group_size=128, q_dtype=torch.float8_e4m3fn),
        )
    tiny = torch.tensor([1e-37, -1e-37, 0.0, 5e-38] * 32, dtype=torch.bfloat16)  # the factor would overflow fp32
    for mantissa in (3, 2):
        back = quantizer.dequantize(quantizer.quantize(tiny, q_mantisa_bits=mantissa), q_mantisa_bits=mantissa)
        assert bool(torch.isfinite(back).all()) and bool(((back.float() - tiny.float()).abs() <= 1e-37).all())
    zeros = quantizer.quantize(torch.zeros(128, dtype=torch.bfloat16))
    assert torch.equal(quantizer.dequantize(zeros), torch.zeros(128, dtype=torch.bfloat16))


def test_quantized_parameter_copies_pickles_and_loads_values() -> None:
    values = torch.randn(8, 64, dtype=torch.bfloat16)
    param = QuantizedParameter(values, quantization_config=QuantizationConfig(group_size=64))
    assert param.dtype == torch.uint8 and not param.requires_grad
    twin = copy.deepcopy(param)
    assert type(twin) is QuantizedParameter and torch.equal(twin.dequantized(), param.dequantized())
    assert twin.data_ptr() != param.data_ptr()
    buffer = io.BytesIO()
    torch.save(param, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is QuantizedParameter and torch.equal(loaded.dequantized(), param.dequantized())
    other = torch.randn(8, 64, dtype=torch.bfloat16)
    param.load_values(other)
    assert torch.equal(
        param.dequantized(), QuantizedParameter(other, quantization_config=param.quantization_config).dequantized()
    )
    with pytest.raises(ValueError, match="requires_grad=True is not supported"):
        QuantizedParameter(values, requires_grad=True)
    param.ds_optim_param = True
    clone = QuantizedParameter(param.data, **param.__dict__)  # how Transformers and Accelerate clone a parameter
    assert torch.equal(clone.data, param.data) and clone.quantization_config == param.quantization_config
    assert torch.equal(clone.dequantized(), param.dequantized()) and clone.ds_optim_param


def test_quantized_layers_compute_with_the_dequantized_weight() -> None:
    torch.manual_seed(0)
    quant = QuantizationConfig(group_size=64)
    layer = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4), quantization_config=quant)
    nn.init.normal_(layer.lora_weight_2.weight)
    assert isinstance(layer.weight, QuantizedParameter)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    w = layer.weight.dequantized()
    x2 = x.detach().clone().requires_grad_()
    want = F.linear(x2, w) + layer.lora_scaling_factor * layer.lora_weight_2(layer.lora_weight_1(x2))
    assert torch.equal(y, want)
    g = torch.randn_like(y)
    y.backward(g)
    want.backward(g)
    assert torch.equal(x.grad, x2.grad)
    plain = QuantizedLinear(64, 32, bias=True, quantization_config=quant)
    x3 = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(plain(x3), F.linear(x3, plain.weight.dequantized(), plain.bias))
    whole = torch.randn(32, 64, dtype=torch.bfloat16)  # a pretrained file's values: quantized as they load
    plain.load_state_dict({"weight": whole, "bias": torch.zeros(32, dtype=torch.bfloat16)})
    assert torch.equal(plain.weight.dequantized(), QuantizedParameter(whole, quantization_config=quant).dequantized())
    before = plain(x3)
    plain.load_state_dict(plain.state_dict(), assign=True)  # the meta-device pattern: a plain parameter of the bytes
    assert torch.equal(plain(x3), before) and isinstance(plain.weight, QuantizedParameter)
    holder = nn.ModuleDict({"q_proj": layer})  # a target's name (a layer loaded under another turns plain)
    holder.load_state_dict(holder.state_dict(), assign=True)
    assert torch.equal(layer(x.detach()), y.detach()) and not layer.disabled


def test_frozen_linear_under_autocast_twice_differentiable_and_kept_weight_switch() -> None:
    from zeroshard.linear.frozen import frozen_linear

    torch.manual_seed(0)
    w, b = torch.randn(48, 64), torch.randn(48, requires_grad=True)
    for bias in (None, b):
        x = torch.randn(2, 7, 64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, want = frozen_linear(x, lambda: w, bias), F.linear(x2, w, bias)
        g = torch.randn(y.shape, dtype=y.dtype)
        (gx, *gb) = torch.autograd.grad(y, [x] + ([b] if bias is not None else []), g)
        (gx2, *gb2) = torch.autograd.grad(want, [x2] + ([b] if bias is not None else []), g)
        assert torch.equal(y, want) and gx.dtype == torch.float32 and torch.equal(gx, gx2)
        assert all(torch.equal(p, q) for p, q in zip(gb, gb2, strict=True))
    x = torch.randn(5, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (gx,) = torch.autograd.grad(frozen_linear(x, lambda: w).square().sum(), x, create_graph=True)
    (gx2,) = torch.autograd.grad(F.linear(x2, w).square().sum(), x2, create_graph=True)
    gx.sum().backward()
    gx2.sum().backward()
    assert torch.equal(gx, gx2) and torch.equal(x.grad, x2.grad)
    quant = QuantizationConfig(group_size=64)
    kept = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4, regather_in_backward=False),
                               quantization_config=quant)  # fmt: skip
    rebuilt = LoRAOptimizedLinear(64, 32, lora_config=LoRAConfig(lora_r=4), quantization_config=quant)
    nn.ModuleDict({"q_proj": rebuilt}).load_state_dict(nn.ModuleDict({"q_proj": kept}).state_dict())
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    kept(x).sum().backward()
    rebuilt(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def _tiny_llama() -> object:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip


def test_init_builds_a_transformers_model_with_lora_layers_and_restores_every_name(tmp_path: object) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForCausalLM
    names = (torch.nn.Linear, auto.from_pretrained, auto.from_config)
    config = _tiny_llama()
    lora = LoRAConfig(lora_r=4, lora_alpha=8)
    with Init(lora_config=lora):
        model = auto.from_config(config)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj, LoRAOptimizedLinear) and q_proj._initialized
    assert isinstance(q_proj.lora_weight_1, nn.Linear) and isinstance(q_proj.lora_weight_2, nn.Linear)
    assert (torch.nn.Linear, auto.from_pretrained, auto.from_config) == names
    assert [n for n, p in model.named_parameters() if p.requires_grad][:2] == [
        "model.layers.0.self_attn.q_proj.lora_weight_1.weight",
        "model.layers.0.self_attn.q_proj.lora_weight_2.weight",
    ]

    torch.manual_seed(0)
    plain = auto.from_config(config).to(torch.bfloat16)
    plain.save_pretrained(tmp_path)
    with Init(lora_config=LoRAConfig(lora_r=4, lora_alpha=8)):
        loaded = auto.from_pretrained(tmp_path)
    layer = loaded.model.layers[0].mlp.down_proj
    assert isinstance(layer, LoRAOptimizedLinear) and layer._initialized
    assert torch.equal(layer.weight, plain.model.layers[0].mlp.down_proj.weight)
    head = loaded.lm_head  # not a target: a plain layer with the file's weight
    assert head.disabled and torch.equal(head.weight, plain.lm_head.weight)
    ids = torch.randint(0, 128, (1, 8))
    baseline = auto.from_pretrained(tmp_path)  # as loaded (rotary buffers in fp32, where `.to` cast them)
    assert torch.equal(loaded(ids).logits, baseline(ids).logits)  # the adapters start at zero
    with pytest.raises(RuntimeError, match="inside"), Init(lora_config=LoRAConfig()):
        raise RuntimeError("inside")
    assert (torch.nn.Linear, auto.from_pretrained, auto.from_config) == names
