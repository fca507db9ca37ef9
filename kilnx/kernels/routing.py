"""Choices between kernels, tuned and stored per device like any kernel config.

Which kernel should serve a call is a measured fact of the device, not a constant: on the H200 the
one-pass GEMV (`qmv`) beat the swapped tile GEMM (`qmm`) at 4 rows and lost at 8, and another GPU
will differ. A route is an object with the kernel protocol (kilnx/dsl/kernel.py) whose tunable is the
choice; compiling a config gives a function that serves a sweep of call shapes with that choice, so
the tuner's gate checks the route's outputs and its timing sums the sweep. The runtime reads the
stored choice through `kilnx.runtime.dispatch.config_for`, like a kernel reads its block sizes.
"""

from __future__ import annotations

import hashlib

import torch

from kilnx.dsl.kernel import format_key
from kilnx.dsl.tunables import Space, choice

ROUTING_VERSION = "1"


class QmatmulRowsRoute:
    """Up to how many rows `qmatmul` uses the one-pass GEMV; more rows take the tile GEMM.

    Args are those of one qmatmul call at the largest row count of the sweep: x (ROWS[-1], K) and the
    packed weight. The bucket is the weight's shape and format (the choice does not depend on M).
    """

    name = "qmatmul_rows_crossover"
    ROWS = (1, 2, 4, 8, 16)

    def __init__(self):
        from kilnx.kernels import qmatmul as qm
        from kilnx.kernels import qmv_h2
        self._qm, self._h2 = qm, qmv_h2
        self.space = Space({"QMV_MAX_ROWS": choice(0, 1, 2, 4, 8, 16, default=qm.QMV_MAX_ROWS)})
        parts = (ROUTING_VERSION + qm.qmv.source_hash + qm.qmm.source_hash + qm.qmv_prep.source_hash
                 + qmv_h2.qmv_h2.source_hash + qmv_h2.qmv_h2_prep.source_hash)
        self.source_hash = hashlib.sha256(parts.encode()).hexdigest()
        self.tolerance = qm._matmul_tolerance
        self.peer = None

    # -- protocol -------------------------------------------------------------------------------------
    def key(self, x, wq, scales, biases, **_) -> str:
        f = self._qm._format_of(x, wq, scales, biases)
        return format_key({"N": wq.shape[0], "K": x.shape[1], "bits": f["BITS"], "gs": f["GROUP"]})

    def default_config(self, *args, **_) -> dict:
        return self.space.default()

    def sample_problems(self) -> list[dict]:
        return [{"N": 4096, "K": 4096, "bits": 4, "gs": 64}]

    def make_args(self, problem: dict, device: str):
        return self._qm.make_qmatmul_args({**problem, "M": self.ROWS[-1]}, device)

    def compile(self, config: dict, *args, backend: str | None = None, **_):
        limit = self.space.validate(config)["QMV_MAX_ROWS"]

        def sweep(x, wq, scales, biases):
            return torch.cat([self.serve(x[:m], wq, scales, biases, limit, backend) for m in self.ROWS])
        return sweep

    def reference(self, x, wq, scales, biases, **_):
        f = self._qm._format_of(x, wq, scales, biases)
        return torch.cat([self._qm._dense_spec(x[:m], wq, scales, biases, f["BITS"], f["GROUP"])
                          for m in self.ROWS])

    # -- the choice itself ----------------------------------------------------------------------------
    def serve(self, x, wq, scales, biases, limit: int, backend: str | None = None):
        """One qmatmul call (x (M, K), 2D) under the choice `limit`."""
        qm = self._qm
        if x.shape[0] <= limit and 32 % qm._format_of(x, wq, scales, biases)["BITS"] == 0:
            # the packed-fp16 GEMV is the faster one on the GPU for the bit widths it serves (H200: 1.3-1.5x
            # at every llama-3.1-8b shape and M <= 8); on the CPU its fp16 helpers are scalar calls
            run = self._h2.run_qmv_h2 if x.is_cuda and self._h2.serves(x, wq, scales, biases) else qm.run_qmv
            y = run(x, wq, scales, biases, backend=backend)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if x.is_cuda and x.shape[0] >= qm.DEQUANT_MM_MIN_ROWS and 32 % qm._format_of(x, wq, scales, biases)["BITS"] == 0:
            return qm.dequant_mm(x, wq, scales, biases)
        return qm.qmm(x, wq, scales, biases, backend=backend)

    def limit_for(self, x, wq, scales, biases) -> int:
        """The stored choice for this device and weight (the default where none was tuned)."""
        from kilnx.runtime.dispatch import config_for
        return config_for(self, (x, wq, scales, biases), {})["QMV_MAX_ROWS"]


qmatmul_rows = QmatmulRowsRoute()
