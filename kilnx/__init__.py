"""kilnx: a JIT kernel compiler and autotuner for LLM inference on NVIDIA GPUs."""

import os as _os

# The quantized kernels count on a*b+c becoming one fma for speed (the magic-number dequantization's
# scale-and-offset is exact either way, but one instruction instead of two per code). Triton fuses by
# default up to 3.9 and announces the opposite default for 3.10: keep it on unless the user says otherwise.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

__version__ = "0.1.0"
