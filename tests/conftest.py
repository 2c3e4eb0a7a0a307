import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `helpers` is importable here and in spawned ranks
os.environ.setdefault("ZEROSHARD_LOG_LEVEL", "WARNING")
