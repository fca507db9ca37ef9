"""How the tuner makes inputs for the library's kernels: random data (never zeros) per problem."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def row_problems(widths=(4096, 14336), rows=(1, 16, 4096)) -> list[dict]:
    return [{"rows": r, "D": d, "dtype": "bf16"} for d in widths for r in rows]


def rows_args(*, n_rows_inputs: int, n_vectors: int, width_factor: int = 1):
    """Problem {rows, D, dtype} -> (row tensors (rows, D*width_factor)..., vectors (D,)...); scalar
    arguments keep the kernel's defaults."""
    def make(problem: dict, device: str):
        dt = DTYPES[problem.get("dtype", "bf16")]
        g = torch.Generator(device="cpu").manual_seed(hash(tuple(sorted(problem.items()))) & 0xFFFF)
        r, d = problem["rows"], problem["D"]
        ts = [torch.randn(r, d * width_factor, generator=g).to(dt).to(device) for _ in range(n_rows_inputs)]
        vs = [(1 + 0.1 * torch.randn(d, generator=g)).to(dt).to(device) for _ in range(n_vectors)]
        return tuple(ts + vs)
    return make
