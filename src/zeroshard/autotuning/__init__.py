"""Autotuning: measured, not guessed. `zeroshard autotune --model DIR --nproc-per-node N` runs short training
trials of the configurations the estimator says may fit (`space.py`, [Note: autotuning space]) in fresh
processes (`trial.py`), keeps every outcome (`tuner.py`, [Note: autotuning results]) and writes the fastest that
fits, a results table and a plot (`report.py`). The `autotuning` block of a ds_config sets the search
(`settings.py`, DeepSpeed's keys and defaults). See docs/autotuning.md.
"""

from zeroshard.autotuning.settings import AutotuningSettings, from_block
from zeroshard.autotuning.space import Experiment, build_space
from zeroshard.autotuning.tuner import Search, Trial, run_search

__all__ = ["AutotuningSettings", "Experiment", "Search", "Trial", "build_space", "from_block", "run_search"]
