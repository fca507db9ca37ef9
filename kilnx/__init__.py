"""kilnx: a JIT kernel compiler and autotuner for LLM inference on NVIDIA GPUs."""

__version__ = "0.1.0"
