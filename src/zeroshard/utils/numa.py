"""`deepspeed.utils.numa.parse_range_list`: DeepSpeed's core-list syntax (`--bind_core_list`), the launcher's parser.

Example:
    >>> parse_range_list("0,2-4,6")
    [0, 2, 3, 4, 6]
"""

from zeroshard.launcher.bind import parse_core_list as parse_range_list

__all__ = ["parse_range_list"]
