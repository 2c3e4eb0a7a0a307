"""Run another script of this folder as if DeepSpeed were not installed: `python without_deepspeed.py SCRIPT ARGS`.

`importlib.util.find_spec("deepspeed")` answers None (accelerate's `is_deepspeed_available()` reads it) and
`import deepspeed` raises ImportError, so the script sees what a machine without DeepSpeed shows it.
"""

import importlib.util
import os
import runpy
import sys

_find_spec = importlib.util.find_spec


def find_spec(name, *args, **kwargs):
    if name == "deepspeed" or name.startswith("deepspeed."):
        return None
    return _find_spec(name, *args, **kwargs)


importlib.util.find_spec = find_spec
sys.modules["deepspeed"] = None  # `import deepspeed` raises ImportError

from accelerate.utils import is_deepspeed_available  # noqa: E402

assert not is_deepspeed_available()
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
