"""zeroshard: ZeRO data parallelism for PyTorch."""
__version__ = "0.1.0"
