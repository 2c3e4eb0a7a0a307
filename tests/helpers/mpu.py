"""A Megatron-style mpu for tests: DeepSpeed's six `get_*_parallel_*` methods over groups a test built."""

from __future__ import annotations

from typing import Any


class GroupsMpu:
    """Subclasses set `tp_rank`, `dp_rank`, `tp_size`, `dp_size`, `tp_group` and `dp_group`."""

    tp_rank: int
    dp_rank: int
    tp_size: int
    dp_size: int
    tp_group: Any
    dp_group: Any

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group
