"""Which modules gather the stage-3 root unit ([Note: root unit by module]): pure, no process group."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.zero.stage3.plan import plan_units, root_entries
from zeroshard.zero.stage3.root import grad_only

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def _root_params(model: nn.Module, threshold: int = 0) -> tuple[str, ...]:
    return next(spec.param_names for spec in plan_units(model, None, threshold) if spec.name == "")


def test_a_gpt_root_unit_is_gathered_by_its_embeddings_final_norm_and_tied_head() -> None:
    model = GPT(TINY)
    assert root_entries(model, None, _root_params(model)) == ["wte", "wpe", "ln_f", "lm_head"]
    # with the small parameters persistent only the tied embedding is left: its two modules gather it
    assert root_entries(model, None, _root_params(model, threshold=1000)) == ["wte", "lm_head"]
    assert grad_only(model.wte) and not grad_only(model.lm_head)


class _OwnParameter(GPT):
    def __init__(self) -> None:
        super().__init__(TINY)
        self.scale = nn.Parameter(torch.ones(TINY.n_embd))


class _SharedWithBlock(GPT):
    def __init__(self) -> None:
        super().__init__(TINY)
        self.blocks[0].attn.proj.weight = self.blocks[1].attn.proj.weight  # two blocks: their ancestor is the root


def test_the_root_stays_whole_when_a_parameter_is_the_roots_own_or_shared_with_a_block() -> None:
    for model in (_OwnParameter(), _SharedWithBlock()):
        assert root_entries(model, None, _root_params(model)) is None


def test_an_embedding_subclass_with_its_own_forward_is_not_taken_as_grad_only() -> None:
    class Scaled(nn.Embedding):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.weight.norm()

    assert not grad_only(Scaled(4, 2)) and grad_only(nn.Embedding(4, 2))


def test_model_persistence_threshold_caps_the_persistent_elements_in_registration_order() -> None:
    """stage3_model_persistence_threshold ([Note: units] in zero/stage3/plan.py): DeepSpeed's mark_persistent_parameters
    takes the small parameters in registration order while their total stays within the cap."""
    model = GPT(TINY)
    small = [(n, p.numel()) for n, p in model.named_parameters() if p.numel() < 10**6]
    uncapped = {s.name: s.param_names for s in plan_units(model, None, 10**6)}["<persistent>"]
    assert list(uncapped) == [n for n, _ in small]
    cap = 3000
    expected, total = [], 0
    for name, numel in small:
        if total + numel <= cap:
            expected.append(name)
            total += numel
    capped = {s.name: s.param_names for s in plan_units(model, None, 10**6, cap)}
    assert list(capped["<persistent>"]) == expected and 0 < len(expected) < len(small)
    assert sorted(n for names in capped.values() for n in names) == sorted(n for n, _ in model.named_parameters())
    assert "<persistent>" not in {s.name for s in plan_units(model, None, 10**6, 0)}
