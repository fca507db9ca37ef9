"""Which decode MoE a GPU runs for an expert stack: the two kernels of moe_h2 or the one pass of moe_onepass.

Why a stored choice and not a constant: whether one launch beats two depends on the expert width and on
the device. On the H200 the two kernels won at every width measured (bench/results/
2026-12-04_h200_moe_onepass_s17.csv, one token on prepared activations: qwen3-30b-a3b 13.6-14.0 us
against the one pass's best 16.1-16.2, mixtral-8x7b 92.4-92.6 against 112.4-112.8); the one pass spends
a program's whole life on one (slot, feature block) whose gate_up rows, activation, down columns and
atomic adds run back to back, where the two kernels give each GEMV its own grid. `kilnx tune` times both
per stack shape and stores the winner like any tuned config; the default is the two kernels.
"""

from __future__ import annotations

import os

from kilnx.dsl.kernel import Route, _tuning_generation, format_key
from kilnx.dsl.tunables import Space, choice

ROUTE_VERSION = "1"
PATHS = ("two_kernels", "onepass")


class MoeDecodeRoute(Route):
    """`PATH` for the decode MoE of one (E, 2F, H) stack pair. Args are moe_onepass_h2's: prepared x (planes,
    sums, xs), the gate_up stack's packed words, scales, biases, down's, expert_ids and routing weights."""

    name = "moe_decode_path"
    version = ROUTE_VERSION

    def __init__(self):
        from kilnx.kernels import moe_h2, moe_onepass
        self._h2, self._one = moe_h2, moe_onepass
        self.space = Space({"PATH": choice(*PATHS, default="two_kernels")})
        self._chosen: dict = {}

    def chosen_between(self) -> tuple:
        return (self._h2.gather_qmv_h2_glu, self._h2.gather_qmv_h2_combine, self._one.moe_onepass_h2)

    # -- protocol -------------------------------------------------------------------------------------
    def key(self, planes, sums, xs, wq, scales, biases, d_packed, d_scales, *_, **__) -> str:
        f = self._one._formats(planes, scales, wq, d_packed, d_scales)
        return format_key({"E": wq.shape[0], "N": wq.shape[1], "K": d_packed.shape[1], "bits": f["BITS"],
                           "gs": f["GROUP"]})

    def default_config(self, *args, **_) -> dict:
        return self.space.default()

    def sample_problems(self) -> list[dict]:
        return [{"E": 128, "top_k": 8, "N": 1536, "K": 2048, "bits": 4, "gs": 64}]

    def make_args(self, problem: dict, device: str):
        return self._one.make_args({**problem, "T": problem.get("T", 1)}, device)

    def compile(self, config: dict, *args, backend: str | None = None, **_):
        path = self.space.validate(config)["PATH"]
        return lambda *a: self.run(path, *a, backend=backend)

    def reference(self, *args, **_):
        return self._one.moe_onepass_h2.reference(*args)

    def tolerance(self, args):
        return self._one.tolerance(args)

    # -- the choice itself ----------------------------------------------------------------------------
    def run(self, path: str, *args, activation: str = "silu", configs=(None, None), backend: str | None = None):
        """(T, H) in scales' dtype by `path` (the one pass's fp32 sum rounded once) from moe_onepass_h2's
        arguments; configs: the two kernels' (None: tuned or default)."""
        if path == "onepass":
            scales = args[4]
            return self._one.moe_onepass_h2(*args, ACT=activation, backend=backend).to(scales.dtype)
        return self._h2.two_kernels(*args, activation=activation, configs=configs, backend=backend)

    def path_for(self, args: tuple) -> str:
        """The stored path for this device and stack pair (the default where none was tuned);
        KILNX_MOE_PATH=two_kernels|onepass overrides it (comparisons)."""
        forced = os.environ.get("KILNX_MOE_PATH")
        if forced:
            if forced not in PATHS:
                raise ValueError(f"KILNX_MOE_PATH must be one of {PATHS}, got {forced!r}")
            return forced
        planes, wq, d_packed = args[0], args[3], args[6]
        memo = (planes.device, planes.shape[1:], wq.shape, d_packed.shape, _tuning_generation[0])
        got = self._chosen.get(memo)
        if got is None:
            from kilnx.runtime.dispatch import config_for
            got = self._chosen[memo] = config_for(self, args, {})["PATH"]
        return got


moe_decode_path = MoeDecodeRoute()

__all__ = ["moe_decode_path", "MoeDecodeRoute", "PATHS"]
