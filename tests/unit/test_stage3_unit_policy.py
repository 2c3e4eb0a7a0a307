"""The default stage-3 unit policy without a process group: repeated blocks of module lists become units, and a
container the parent calls into directly (no forward of its own) is looked into instead ([Note: ...] in
`default_unit_policy`: its unit would never be gathered)."""

from __future__ import annotations

from torch import nn

from zeroshard.zero.stage3.plan import default_unit_policy


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.b(self.a(x))


class _Grid(nn.Module):
    """Rows of linears in plain ModuleLists, called tile by tile (DeepSpeed's TiledLinear layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.ModuleList(nn.ModuleList(nn.Linear(3, 3) for _ in range(2)) for _ in range(3))
        self.blocks = nn.ModuleList(_Block() for _ in range(2))


def test_blocks_are_units_and_uncalled_containers_are_not() -> None:
    model = _Grid()
    policy = default_unit_policy(model)
    units = [name for name, module in model.named_modules() if policy(name, module)]
    assert units == ["blocks.0", "blocks.1"]
