"""`zeroshard.checkpointing` without a process group: configure's precedence and checks, the config block,
RNG replay in the recompute, outputs that are not tensors, evaluation under no_grad."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard import checkpointing
from zeroshard.errors import ConfigError, ZeroshardError


@pytest.fixture(autouse=True)
def _defaults():
    checkpointing.configure(None)
    yield
    checkpointing.configure(None)
    checkpointing.reset()


def test_configure_applies_the_block_then_the_keywords():
    config = {"activation_checkpointing": {"cpu_checkpointing": True, "profile": True, "number_checkpoints": 3}}
    checkpointing.configure(None, deepspeed_config=config, profile=False)
    s = checkpointing.settings()
    assert checkpointing.is_configured()
    assert (s.cpu_checkpointing, s.profile, s.number_checkpoints, s.partition_activations) == (True, False, 3, False)
    checkpointing.configure(None)  # back to the defaults, as DeepSpeed's configure starts from them
    assert checkpointing.settings().cpu_checkpointing is False


def test_the_setters_change_one_setting_and_configure_nothing():
    """DeepSpeed's `set_num_layers` and `partition_activations_in_checkpoint` assign one global each."""
    checkpointing.deepspeed_checkpointing_enabled = False  # as before any configure (the fixture configured)
    checkpointing.set_num_layers(3)
    checkpointing.partition_activations_in_checkpoint(True)
    s = checkpointing.settings()
    assert (s.number_checkpoints, s.partition_activations, s.cpu_checkpointing) == (3, True, False)
    assert not checkpointing.is_configured() and not checkpointing.deepspeed_checkpointing_enabled


@pytest.mark.parametrize(
    ("options", "needs"),
    [
        ({"contiguous_checkpointing": True, "num_checkpoints": 2}, "partition_activations"),
        ({"contiguous_checkpointing": True, "partition_activations": True}, "number_checkpoints"),
    ],
)
def test_contiguous_checkpointing_needs_partitioning_and_a_count(options, needs):
    with pytest.raises(ConfigError, match=needs):
        checkpointing.configure(None, **options)


def test_dropout_is_replayed_and_non_tensor_outputs_pass_through():
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, str, torch.Tensor]:
        y = layer(x)
        return y, "tag", y.argmax(-1)

    checkpointing.configure(None, synchronize=True, profile=True)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(3)
        x = torch.randn(4, 8, requires_grad=True)
        layer.zero_grad()
        y, tag, index = checkpointing.checkpoint(fn, x) if use_checkpoint else fn(x)
        assert tag == "tag" and index.dtype == torch.int64 and not index.requires_grad
        (y * torch.arange(8.0)).sum().backward()
        grads.append((x.grad.clone(), layer[0].weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    stats = checkpointing.stats()
    assert stats.calls == 1 and stats.forward_s > 0 and stats.backward_s > 0


def test_cpu_checkpointing_keeps_the_input_off_the_device_until_backward():
    checkpointing.configure(None, checkpoint_in_cpu=True)
    x = torch.randn(16, 8, requires_grad=True)
    y = checkpointing.checkpoint(nn.Linear(8, 8), x)
    assert checkpointing.stats().host_bytes == x.numel() * 4 and checkpointing.stats().device_bytes == 0
    y.sum().backward()
    assert checkpointing.stats().host_bytes == 0 and x.grad is not None


def test_under_no_grad_the_function_just_runs():
    with torch.no_grad():
        y = checkpointing.checkpoint(nn.Linear(4, 4), torch.randn(2, 4))
    assert y.grad_fn is None and checkpointing.stats().peak_device_bytes == 0


def test_rng_tracker_forks_a_named_stream():
    tracker = checkpointing.get_cuda_rng_tracker()
    checkpointing.model_parallel_cuda_manual_seed(11)
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the named stream advances between forks
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    tracker.reset()


def _in_flight(count: int | None) -> list[torch.Tensor]:
    """A 1F1B steady state with two micro-batches in flight (f1 f2 b1 f3 b2 f4 b3 b4), each forward one checkpoint:
    the input gradients of the four micro-batches."""
    if count is not None:
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=count)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())  # its input gradient depends on the input kept
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(4)]
    run = checkpointing.checkpoint if count is not None else (lambda fn, x: fn(x))
    outs = [run(layer, xs[0]), run(layer, xs[1])]
    for k in range(2, 4):
        (outs[k - 2] ** 2).sum().backward()
        outs.append(run(layer, xs[k]))
    for k in range(2, 4):
        (outs[k] ** 2).sum().backward()
    return [x.grad for x in xs]


def test_contiguous_pieces_are_held_until_their_backward():
    """[Note: contiguous pieces are taken and given back]: a piece is free again only once its input is restored, so
    micro-batches in flight never share one (handed out in a circle and rewound at each backward, the fourth forward
    overwrote the third's input: its gradients were another micro-batch's); more held inputs than number_checkpoints
    are refused in one line (they wrapped around silently)."""
    want = _in_flight(None)
    got = _in_flight(2)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    layer = nn.Linear(8, 8)
    with pytest.raises(ZeroshardError, match="number_checkpoints is 1, and 1 checkpointed inputs are held"):
        checkpointing.checkpoint(layer, checkpointing.checkpoint(layer, torch.randn(4, 8, requires_grad=True)))


def test_the_recompute_runs_under_the_forwards_autocast():
    """Autograd does not carry autocast into backward: the recompute re-enters the forward's (it ran in fp32 under
    torch_autocast's bf16, so the gradients were another function's)."""
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        layer = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpointing.checkpoint(layer, x) if use_checkpoint else layer(x)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
        grads.append([x.grad, *[p.grad for p in layer.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_keyword_arguments_take_part_in_autograd_as_deepspeeds():
    """DeepSpeed 0.19.8's `checkpoint(function, *args, **kwargs)` (its TestActivationCheckpointKeywordArguments): a
    tensor passed by keyword gets its gradient, a plain value passes through; before, a TypeError."""
    calls = []

    def function(value, *, scale, offset):
        calls.append(offset)
        return value * scale + offset

    value, scale = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    checkpointing.checkpoint(function, value, scale=scale, offset=1.5).sum().backward()
    assert torch.equal(scale.grad, value.detach()) and torch.equal(value.grad, scale.detach())
    assert calls == [1.5, 1.5]  # the forward, then the recompute in backward
    with torch.no_grad():
        assert torch.equal(checkpointing.checkpoint(function, value, scale=scale, offset=0.0), value * scale)


def test_non_reentrant_checkpoint_gives_an_embedding_its_gradient_and_refuses_kept_copies():
    """DeepSpeed's `non_reentrant_checkpoint` (the pipeline's `use_reentrant: false` puts it in place): inputs that
    need no gradient still give the layers inside theirs; the partitioned/host copies are `checkpoint`'s only."""
    embedding = nn.Embedding(10, 4)
    ids = torch.tensor([1, 2, 2])
    checkpointing.non_reentrant_checkpoint(embedding, ids).sum().backward()
    assert torch.equal(embedding.weight.grad.sum(dim=1), torch.tensor([0, 4, 8, 0, 0, 0, 0, 0, 0, 0.0]))
    checkpointing.configure(None, checkpoint_in_cpu=True)
    with pytest.raises(ZeroshardError, match="apply to checkpointing.checkpoint only"):
        checkpointing.non_reentrant_checkpoint(embedding, ids)


def test_non_reentrant_checkpoint_gives_keyword_arguments_to_the_function():
    """`debug` and `preserve_rng_state` are the function's here, not torch's checkpoint options (they were taken)."""
    seen = []

    def function(x, debug=False, preserve_rng_state="unset"):
        seen.append((debug, preserve_rng_state))
        return torch.sin(x)  # saves x: the backward recomputes

    x = torch.randn(3, requires_grad=True)
    checkpointing.non_reentrant_checkpoint(function, x, debug=True, preserve_rng_state="mine").sum().backward()
    assert seen == [(True, "mine"), (True, "mine")] and torch.allclose(x.grad, torch.cos(x.detach()))
