"""`MoE`: DeepSpeed's `deepspeed.moe.layer.MoE` (its arguments and its `(output, l_aux, exp_counts)`).

```python
from zeroshard.moe.layer import MoE  # was: from deepspeed.moe.layer import MoE

class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.moe = MoE(hidden_size=d, expert=ffn, num_experts=8, ep_size=2, k=1)

    def forward(self, x):
        out, l_aux, _ = self.moe(x)
        return x + out, l_aux
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.moe.exchange import exchange_capacities, from_experts, to_experts
from zeroshard.moe.experts import Experts
from zeroshard.moe.gating import GateOutput, top1gating, top2gating, topkgating
from zeroshard.moe.groups import ExpertGroups

_NOISY = (None, "None", "Jitter", "RSample")


def _refuse(
    hidden_size: int, num_experts: int, ep_size: int, k: int, noisy: str | None, tutel: bool, etp: bool
) -> None:
    if tutel:
        raise ValueError("MoE(use_tutel=True): zeroshard has no Tutel kernels; use_tutel=False gives the same math")
    if etp:
        raise ValueError(
            "MoE(enable_expert_tensor_parallelism=True): expert tensor parallelism is not supported; experts are "
            "expert- and data-parallel only"
        )
    if not 1 <= k <= num_experts:
        raise ValueError(f"MoE(k={k}): choose k from 1 to num_experts ({num_experts})")
    if noisy not in _NOISY:
        raise ValueError(f"MoE(noisy_gate_policy={noisy!r}): choose one of {_NOISY}")
    if num_experts % ep_size:
        raise ValueError(f"MoE: num_experts={num_experts} must be a multiple of ep_size={ep_size}")
    if hidden_size <= 0:
        raise ValueError(f"MoE: hidden_size={hidden_size} must be positive")


@dataclass(frozen=True)
class GatePolicy:
    """How the gate routes ([Note: gating]); DeepSpeed's `MoE` arguments of the same names."""

    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True


class TopKGate(nn.Module):
    """The gate: a bias-free fp32 linear scoring tokens against experts, then [Note: gating]."""

    def __init__(self, policy: GatePolicy, hidden_size: int, num_experts: int):
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False).float()
        self.policy = policy

    def forward(self, tokens: torch.Tensor, used_token: torch.Tensor | None = None) -> GateOutput:
        p = self.policy
        x = tokens.float()
        if p.noisy_gate_policy == "Jitter" and self.training:  # DeepSpeed's multiplicative jitter, eps 1e-2
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = p.capacity_factor if self.training else p.eval_capacity_factor
        if p.k == 1:
            noisy = p.noisy_gate_policy if self.training else None
            return top1gating(logits, factor, p.min_capacity, noisy, p.drop_tokens, p.use_rts, used_token)
        if used_token is not None:  # (DeepSpeed's gate drops it silently there)
            raise ValueError(f"MoE(k={p.k}).forward(used_token=...): only top-1 gating masks tokens")
        if p.k == 2:
            return top2gating(logits, factor, p.min_capacity, p.drop_tokens, p.top2_2nd_expert_sampling)
        return topkgating(logits, p.k, factor, p.min_capacity, p.drop_tokens)


class MoE(nn.Module):
    """A mixture-of-experts layer with expert parallelism over `ep_size` ranks ([Note: expert groups]).

    Arguments as DeepSpeed's. `forward(hidden_states)` returns `(output, l_aux, exp_counts)`: the output in the
    input's shape, the load-balancing loss to add (scaled) to the training loss, and the tokens each expert was
    assigned on this rank. `use_residual=True` is the Residual-MoE: a dense copy of `expert` runs on every token
    and a learned 2-way softmax mixes it with the experts' output. Build it after `torch.distributed` is
    initialised (its groups are made here); `expert_groups` shares one set of groups between layers.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        expert_groups: ExpertGroups | None = None,
    ):
        super().__init__()
        _refuse(hidden_size, num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism)
        policy = GatePolicy(
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.use_residual = use_residual
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.groups = expert_groups if expert_groups is not None else ExpertGroups(ep_size)
        if self.groups.mesh.ep_size != ep_size:
            raise ValueError(f"MoE: expert_groups are for ep_size={self.groups.mesh.ep_size}, not {ep_size}")
        # DeepSpeed's module tree, so that state_dict keys match (deepspeed_moe.gate.wg.weight, ...)
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.gate = TopKGate(policy, hidden_size, num_experts)
        self.deepspeed_moe.experts = Experts(expert, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def gate(self) -> TopKGate:
        gate = self.deepspeed_moe.gate
        assert isinstance(gate, TopKGate)
        return gate

    @property
    def experts(self) -> Experts:
        experts = self.deepspeed_moe.experts
        assert isinstance(experts, Experts)
        return experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to build the groups; here they are built at construction (or by initialize
        in a pipeline) and made again in the "D + E" layout when asked ([Note: expert groups]; collective)."""
        self.groups.use_topology(use_data_before_expert_parallel_)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters that differ across the expert-parallel group ([Note: expert groups])."""
        return list(self.experts.parameters())

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.groups.pending:
            raise ZeroshardError(
                "MoE built by a PipelineModule stage: its expert groups are made by zeroshard.initialize; run the "
                "model through the engine it returns ([Note: expert groups in a pipeline])"
            )
        model = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model)
        gate: GateOutput = self.gate(tokens, None if used_token is None else used_token.reshape(-1))
        dispatched = torch.einsum("sec,sm->ecm", gate.dispatch.type_as(tokens), tokens)
        capacities = exchange_capacities(self.groups.ep, gate.capacity, tokens.device)
        outputs = self.experts(to_experts(dispatched, self.groups.ep, capacities))
        expert_out = from_experts(outputs, self.groups.ep, capacities, gate.capacity)
        out = torch.einsum("sec,ecm->sm", gate.combine.type_as(tokens), expert_out).reshape(hidden_states.shape)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * mix[..., 0:1] + dense * mix[..., 1:]
        return out, gate.l_aux, gate.exp_counts
