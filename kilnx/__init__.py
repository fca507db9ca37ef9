"""kilnx: a JIT kernel compiler and autotuner for LLM inference on NVIDIA GPUs."""

__version__ = "0.1.0"

import os as _os

# The CPU backend's generated numba code is dominated by LLVM optimisation time at the default level
# (a 4-bit GEMV took 250 s to compile at 3, 77 s at 1, 16 s at 0). Set NUMBA_OPT yourself to trade
# compile time for CPU speed.
_os.environ.setdefault("NUMBA_OPT", "0")
