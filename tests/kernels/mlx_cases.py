"""MLX as the independent reference for the affine quantized GEMMs: one random case, shared by the
kernel suites (qmatmul, qmv_h2, qmv_tc, qmv_cpu)."""

from __future__ import annotations

import numpy as np
import torch


def mlx_case(m, n, k, bits, gs, seed, *, x_scale=1.0, x_dtype=None):
    """(x, QWeight, MLX's x @ w.T): w quantized by `mx.quantize`; x rounded to `x_dtype` first when given
    (MLX then multiplies exactly that x, in fp32)."""
    import mlx.core as mx
    from kilnx.quant import QWeight
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = torch.from_numpy((rng.standard_normal((m, k)) * x_scale).astype(np.float32))
    if x_dtype is not None:
        x = x.to(x_dtype)
    wq, s, b = mx.quantize(mx.array(w), group_size=gs, bits=bits)
    want = mx.quantized_matmul(mx.array(x.float().numpy()), wq, s, b, transpose=True, group_size=gs, bits=bits)
    qw = QWeight.from_mlx(np.array(wq), np.array(s), np.array(b), bits=bits, group_size=gs)
    return x, qw, torch.from_numpy(np.array(want))
