"""A Hugging Face experts module split over an expert-parallel group: `expert_parallel` ([Note: AutoEP] in
moe/auto.py).

[Note: routed rows]
transformers 5's MoE blocks route with their own router and call their experts module as
`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`: each expert's rows are
computed, weighted and summed into the token's output in ascending expert order. `ParallelExperts` takes that
call. Rank j of the expert-parallel group holds experts `j*L .. j*L+L-1` (`L = E / ep`, the rows of every
`[E, ...]` parameter). The `T*k` (token, choice) pairs are sorted by expert (stable, so by owning rank), one
all-to-all of the `[ep, L]` counts tells each rank what it receives, and one uneven all-to-all each moves the
hidden rows and their routing weights (differentiable: the router's gradient comes back through it). The
receiver calls the model's own experts module, sliced to its `L` experts, with one choice per row: each row is
exactly what the single-process module computes for that (token, expert) pair (its activation, biases, clamps
and weighting included, whatever the model or its `experts_implementation`). The rows travel back and are added
into the tokens' outputs in the sorted order, which is ascending expert order per token: the summation order of
transformers' eager experts on one process (its grouped_mm and batched_mm add a token's k rows in fp32 and round
once; here each row is rounded to the compute dtype first: bf16 results then differ in the last bits, fp32 ones
agree to 1e-6). Nothing is dropped (no capacity), and every rank issues the same collectives in the same order
however the tokens are routed ([Note: expert exchange]): a rank no token reached still puts its experts'
parameters in the graph between the exchanges (`_no_rows`), so that their gradients arrive where its peers' do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.moe.exchange import exchange
from zeroshard.moe.groups import ExpertGroups


class ParallelExperts(nn.Module):
    """[Note: routed rows] A model's experts module (sliced in place to this rank's experts) behind the exchange.

    Its parameters are the wrapped module's own `Parameter` objects under the same names, so state_dict keys
    and optimizer groups built before `initialize` stay valid; each holds this rank's `L` rows of the `[E, ...]`
    tensor ([Note: expert checkpoints] in moe/checkpoint.py names them in the whole tensor).
    """

    local: nn.Module  # the wrapped module, kept out of the module tree (its parameters are registered here)

    def __init__(self, experts: nn.Module, groups: ExpertGroups, num_experts: int):
        super().__init__()
        self.__dict__["local"] = experts  # not a submodule: its parameters are registered here, under their names
        for name, param in experts.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in experts.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in experts._non_persistent_buffers_set)
        self.groups = groups
        self.ep_size = groups.mesh.ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.expert_group_name = f"ep_size_{self.ep_size}"

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters that differ across the expert-parallel group ([Note: expert groups])."""
        return list(self.parameters())

    def train(self, mode: bool = True) -> ParallelExperts:
        super().train(mode)
        self.local.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ParallelExperts:
        """`.to()`, `.half()`, ...: the wrapped module computes with the parameters registered here, also when torch
        replaces parameter objects on conversion (`torch.__future__.set_overwrite_module_params_on_conversion`)."""
        super()._apply(fn, recurse)
        self.local._parameters.update(self._parameters)
        self.local._buffers.update({k: v for k, v in self._buffers.items() if k in self.local._buffers})
        return self

    def _no_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[Note: routed rows] No token reached this rank's experts. Their parameters join the graph here all the
        same, between the two exchanges, where a peer's experts use theirs: their (zero) gradients arrive at the
        point in backward where the peer's do, so both ranks reduce their expert buckets in one order (an expert
        bucket launched mid-backward on one rank, at the end on the other, hung ZeRO 1-2 with overlap_comm false),
        and the combine exchange is in this rank's graph even when nothing before the layer trains."""
        touched = [p.reshape(-1)[:1].sum() for p in self.parameters() if p.requires_grad]
        return rows + torch.stack(touched).sum() * 0 if touched else rows

    def extra_repr(self) -> str:
        return f"{type(self.local).__name__}, experts {self.num_local_experts} of {self.num_experts} on this rank"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        ep, local = self.groups.ep, self.num_local_experts
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # by expert, so by owning rank
        token_of = order // k
        counts = torch.bincount(chosen, minlength=self.num_experts).reshape(self.ep_size, local)
        received = torch.empty_like(counts)  # [source rank, local expert]
        ep.all_to_all_uneven(received, counts, [1] * self.ep_size, [1] * self.ep_size, label="autoep.counts")
        send, receive = counts.sum(1).tolist(), received.sum(1).tolist()  # one device-to-host read per call
        # one node for both: their backward exchanges run in one order on every rank
        rows, weights = exchange(
            ep, send, receive, "autoep.dispatch", tokens[token_of], top_k_weights.reshape(-1, 1)[order]
        )
        ids = torch.arange(local, device=chosen.device, dtype=chosen.dtype).repeat(self.ep_size)
        # (the length known on the host: no device-to-host sync to size the result)
        local_ids = torch.repeat_interleave(ids, received.reshape(-1), output_size=sum(receive))
        out = self.local(rows, local_ids.unsqueeze(1), weights) if rows.shape[0] else self._no_rows(rows)
        (back,) = exchange(ep, receive, send, "autoep.combine", out)
        return _combine(tokens, top_k_index.reshape(-1, k), order, token_of, back).reshape(hidden_states.shape)


def _combine(
    tokens: torch.Tensor, top_k: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor, back: torch.Tensor
) -> torch.Tensor:
    """The rows `back` (sorted by expert) summed into their tokens in ascending expert order, one `index_add_` per
    choice rank: each pass adds one row per token, so the order holds on CUDA too, where one `index_add` over
    repeated indices adds with atomics in any order (and top-k >= 3 sums would differ from run to run). Each add
    rounds to the compute dtype, as transformers' eager loop over experts does (the CPU's one `index_add` over
    repeated indices summed bf16 rows in fp32 and rounded once). No count is read on the host: every choice rank
    has exactly one row per token."""
    rank = torch.argsort(torch.argsort(top_k, dim=1), dim=1).reshape(-1)[order]  # a row's place among its token's
    by_rank = torch.argsort(rank, stable=True).view(top_k.shape[1], -1)
    back = back.to(tokens.dtype)
    combined = torch.zeros_like(tokens)
    for rows in by_rank:
        combined.index_add_(0, token_of[rows], back[rows])
    return combined
