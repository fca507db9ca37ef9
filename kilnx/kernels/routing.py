"""Choices between kernels, tuned and stored per device like any kernel config.

Which kernel should serve a call is a measured fact of the device, not a constant: on the H200 the
fp32 GEMV (`qmv`) beat the swapped tile GEMM (`qmm`) at 4 rows and lost at 8, the packed-fp16 one
(`qmv_h2`) still won at 8, and another GPU or the CPU will differ. A route is an object with the kernel protocol (kilnx/dsl/kernel.py) whose tunable is the
choice; compiling a config gives a function that serves a sweep of call shapes with that choice, so
the tuner's gate checks the route's outputs and its timing sums the sweep. The runtime reads the
stored choice through `kilnx.runtime.dispatch.config_for`, like a kernel reads its block sizes.
"""

from __future__ import annotations

import os

import torch

from kilnx.dsl.kernel import Route, _tuning_generation, format_key
from kilnx.dsl.tunables import Space, choice

# 7: qmm_wg_direct for 4-16 rows on sm_90 (session 21); 8: WG_REPACKED (session 26); 9: WG_MAX_ROWS kept at 16;
# 10: WG_MAX_ROWS a constant, no longer a tunable
ROUTING_VERSION = "10"
# The kernels a qmatmul call can take (`QmatmulRowsRoute.server_of_path`)
PATHS = ("qmv", "qmv_h2", "qmv_il", "qmv_tc", "qmm_wg_direct", "qmm_wg", "qmm", "dequant_mm")
TC_NEVER = 65            # past qmv_tc.MAX_ROWS: the tensor-core GEMV is never chosen
# On the H200 qmv_tc took the same time at 1, 4 and 8 rows and beat qmv_h2 at 8 on every llama-3.1-8b
# shape (by 9-15%), lost at 4 (by 29-71%) (bench/results/2026-12-03_h200_quant_s5.csv); kilnx tune
# stores the crossover per device.
TC_MIN_ROWS = 8
# From these rows up to WG_MAX_ROWS bf16 calls of 4-bit group-64 weights take qmm_wg_direct (wgmma, the
# weight decoded into its register operand; kernels/wg_direct.py) on sm_90 and later. On the H200 at 4 rows it
# took 10.5 / 9.9 / 43.1 / 26.3 us on llama-3.1-8b's qkv / o / gate_up / down against qmv_h2's path 13.6 /
# 12.2 / 42.8 / 31.9, at 16 rows 11.2 / 10.0 / 45.1 / 24.1 against 46.1 / 42.3 / 191.5 / 140.8, and lost at
# one row (bench/results/2026-12-05_h200_qmv_direct_s21.csv).
WG_MIN_ROWS = 4
WG_NEVER = 65            # past WG_MAX_ROWS: qmm_wg_direct is never chosen
# Up to 64 rows the wgmma kernels run all of x's rows in one program, but only 4-16 rows were measured in the engine;
# offered 32 / 64 as a tunable, a 100 s tune on the H100 took them with the copy off (the sweep's 32-row call outweighs
# the decode rows), and the tuned route decoded 4 rows at 0.88x the default's rate (bench/results/*_route_tuned_s32.csv)
WG_MAX_ROWS = 16
WG_KERNEL_MAX_ROWS = 64  # the most rows the wgmma kernels serve (not the most they were measured fast at: 16)


# Rows from which the GPU dequantizes the weight to bf16 once and runs the dense GEMM: at M=512 and 4096 on
# llama-3.1-8b gate_up this took 1.99x and 1.44x cuBLAS's time where the fused qmm took 3.16x and 3.04x
# (H200, bench/results/*_qmm_s3.csv). Below a few hundred rows the weight's 16-bit copy is the larger cost.
DEQUANT_MM_MIN_ROWS = 256
# ... and where the fused qmm decodes 4-bit codes in bf16 pairs (kernels/bf16_decode.py): on gate_up (H200,
# session 15) it took 187 us against the two kernels' 208 at M=256, 278 against 253 at 384, 354 against 282
# at 512; the two lines cross near 320 rows
DEQUANT_MM_MIN_ROWS_PACKED = 320


# Up to these rows a fused grid that 128-wide tiles would starve takes 64 x 64 x 128 tiles instead (packed
# bf16 decode), and above them the two kernels. Alone (bench/results/2026-12-04_h200_qmm_rows_s16.csv,
# H200), llama-3.1-8b's o / qkv / down took 27-28 / 41 / 112-116 us fused against 42-43 / 57-58 / 149-150 for
# the two kernels at 80 and 128 rows, 40 / 52 / 137 against 44 / 57 / 151 at 192, and lost at 256. In the
# model, the graph-replayed prefill of 128 tokens took 11.6-11.8 ms against 12.2-12.3 with the two kernels,
# but of 192 tokens 15.8-16.0 against 15.1 (bench/results/2026-12-04_h200_e2e_s16_narrow192_*.csv). Why the
# isolated times mislead at 192 is not established: under PDL the profile charges the fused kernels' tails
# to the norm after them (profiles/2026-12-04_h200_prefill192_llama8b_narrow192_*.txt)
NARROW_TILE_MAX_ROWS = 128


def starved(m: int, n: int, sms: int) -> bool:
    """Whether 128 x 128 tiles over (m, n) give fewer programs than the GPU has SMs: each of those few
    programs walks all of K, and the rest of the GPU idles."""
    return -(-m // 128) * -(-n // 128) < sms


def takes_dequant_mm(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases) -> bool:
    """Whether qmatmul on the GPU takes the two-kernel path: from DEQUANT_MM_MIN_ROWS(_PACKED) rows, and above
    the narrow tiles' rows (64 for the fp32 decode's kernel, NARROW_TILE_MAX_ROWS for the packed one) wherever
    128-wide fused tiles would starve the grid."""
    from kilnx.kernels import bf16_decode
    from kilnx.kernels import qmatmul as qm
    if not x.is_cuda:
        return False
    packed = bf16_decode.serves(qm._format_of(x, wq, scales, biases)["BITS"], x.dtype, scales.dtype)
    min_rows, narrow = (DEQUANT_MM_MIN_ROWS_PACKED, NARROW_TILE_MAX_ROWS) if packed else (DEQUANT_MM_MIN_ROWS, 64)
    return two_kernels_win(x.shape[0], wq.shape[0], min_rows, narrow, qm.sm_count(x))


def two_kernels_win(m: int, n: int, min_rows: int, narrow_max_rows: int, sms: int) -> bool:
    """The route's rule for m rows of an n-row weight on sms SMs: the two kernels from min_rows, and from
    narrow_max_rows (up to which the fused kernel's tiles are 64 wide) where 128-wide tiles starve the grid."""
    return m >= min_rows or (m > max(64, narrow_max_rows) and starved(m, n, sms))


class QmatmulRowsRoute(Route):
    """Which GEMV `qmatmul` uses (`GEMV`: the fp32 qmv or the packed-fp16 qmv_h2, where its bit width
    allows) and up to how many rows (`QMV_MAX_ROWS`); more rows take the tile GEMM. From `TC_MIN_ROWS`
    rows up to qmv_tc.MAX_ROWS, 16-bit activations take the tensor-core GEMV (qmv_tc) instead; before that,
    from `WG_MIN_ROWS` up to WG_MAX_ROWS (16) rows, bf16 calls of 4-bit group-64 weights take
    qmm_wg_direct, or with `WG_REPACKED` qmm_wg on a repacked copy where memory allows.

    Args are those of one qmatmul call at the largest row count of the sweep: x (ROWS[-1], K) and the
    packed weight. The bucket is the weight's shape and format (the choice does not depend on M).
    """

    name = "qmatmul_rows_crossover"
    version = ROUTING_VERSION
    ROWS = (1, 2, 4, 8, 16, 32)

    def __init__(self):
        from kilnx.kernels import qmatmul as qm
        from kilnx.kernels import qmv_cpu, qmv_h2, qmv_tc, qmv_wg, wg_direct
        self._qm, self._h2, self._tc, self._il, self._wg = qm, qmv_h2, qmv_tc, qmv_cpu, wg_direct
        self._wgr = qmv_wg
        self.space = Space({"QMV_MAX_ROWS": choice(0, 1, 2, 4, 8, 16, 32, default=qm.QMV_MAX_ROWS),
                            # qmv_h2 was 1.06-1.53x faster than qmv at every llama-3.1-8b shape, M = 1..8
                            # (H200, bench/results/2026-12-02_h200_qmv_h2_s3.csv)
                            "GEMV": choice("qmv", "qmv_h2", "qmv_il", default="qmv_h2"),
                            "TC_MIN_ROWS": choice(1, 2, 4, 6, 8, 12, 16, TC_NEVER, default=TC_MIN_ROWS),
                            "WG_MIN_ROWS": choice(2, 3, 4, 6, 8, 12, 16, WG_NEVER, default=WG_MIN_ROWS),
                            # those rows through qmm_wg on a repacked copy of the weight (kernels/qmv_wg.py)
                            # where memory allows; the default is per weight (qmv_wg.repack_pays)
                            "WG_REPACKED": choice(False, True, default=False)})
        self._chosen: dict = {}
        # the kernels it chooses between, hashed when first asked (as theirs are: kilnx/dsl/kernel.py)
        self._hashed = (qm.qmv, qm.qmm, qm.qmv_prep, qmv_h2.qmv_h2, qmv_h2.qmv_h2_prep, qmv_tc.qmv_tc, qmv_cpu.qmv_il,
                        wg_direct.qmm_wg_direct, qmv_wg.qmm_wg)
        self.tolerance = qm._matmul_tolerance

    def chosen_between(self) -> tuple:
        return self._hashed

    # -- protocol -------------------------------------------------------------------------------------
    def key(self, x, wq, scales, biases, **_) -> str:
        f = self._qm._format_of(x, wq, scales, biases)
        return format_key({"N": wq.shape[0], "K": x.shape[1], "bits": f["BITS"], "gs": f["GROUP"]})

    def default_config(self, x, *args, **_) -> dict:
        if x.device.type == "cpu":
            # numba: the row-interleaved GEMV (kernels/qmv_cpu.py) ran SmolLM2's decode GEMVs 1.3-2.3x
            # faster than qmv on 2 EPYC cores. Its time grows with the rows while the tile GEMM's barely
            # does (the GEMM's weight decoding dominates it here), and they cross between 32 and 64 rows
            # on SmolLM2's shapes (0.65-4.05 ms against 1.06-7.02 at 32 rows, 1.6-7.5 against 1.6-7.4 at
            # 64): prompts and prefill chunks up to 32 rows take the GEMV
            return self.space.validate({"QMV_MAX_ROWS": 32, "GEMV": "qmv_il", "TC_MIN_ROWS": TC_NEVER,
                                        "WG_MIN_ROWS": WG_NEVER})
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:   # wgmma: sm_90
            return self.space.validate({"WG_MIN_ROWS": WG_NEVER})
        return self.space.validate({"WG_REPACKED": self._wgr.repack_pays(args[0])})

    def sample_problems(self) -> list[dict]:
        return [{"N": 4096, "K": 4096, "bits": 4, "gs": 64}]

    def make_args(self, problem: dict, device: str):
        return self._qm.make_qmatmul_args({**problem, "M": self.ROWS[-1]}, device)

    def compile(self, config: dict, *args, backend: str | None = None, **_):
        chosen = self.space.validate(config)

        def sweep(x, wq, scales, biases):
            return torch.cat([self.serve(x[:m], wq, scales, biases, chosen, backend) for m in self.ROWS])
        return sweep

    def reference(self, x, wq, scales, biases, **_):
        f = self._qm._format_of(x, wq, scales, biases)
        return torch.cat([self._qm._dense_spec(x[:m], wq, scales, biases, f["BITS"], f["GROUP"])
                          for m in self.ROWS])

    # -- the choice itself ----------------------------------------------------------------------------
    def serve(self, x, wq, scales, biases, chosen: dict, backend: str | None = None):
        """One qmatmul call (x (M, K), 2D) under the choice `chosen` ({QMV_MAX_ROWS, GEMV})."""
        return self.server(x, wq, scales, biases, chosen, backend)(x, wq, scales, biases)

    def server(self, x, wq, scales, biases, chosen: dict, backend: str | None = None):
        """The call `serve` makes for x's row count and this weight format, as a function of
        (x, wq, scales, biases): qmatmul keeps it per weight and row count (a decode step makes a
        hundred qmatmul calls, each of which would otherwise redo these decisions)."""
        return self.server_of_path(self.path(x, wq, scales, biases, chosen), x, wq, scales, biases, backend)

    def path(self, x, wq, scales, biases, chosen: dict) -> str:
        """Which of PATHS serves this call under `chosen`: its `PATH` (the per-row-count choice of
        kernels/qmatmul_path.py) where it has one that serves the call, else the thresholds' rule. A/Bs set
        the PATH aside: KILNX_QMATMUL_PATH=rule, or a KILNX_WG setting of the thresholds' wgmma rows."""
        tuned = chosen.get("PATH")
        aside = os.environ.get("KILNX_WG") or os.environ.get("KILNX_QMATMUL_PATH") == "rule"
        if tuned is not None and not aside and self.serves(tuned, x, wq, scales, biases):
            return tuned
        return self.rule_path(x, wq, scales, biases, chosen)

    def rule_path(self, x, wq, scales, biases, chosen: dict) -> str:
        """The path the thresholds (QMV_MAX_ROWS, GEMV, TC_MIN_ROWS, WG_*) give this call."""
        bits = self._qm._format_of(x, wq, scales, biases)["BITS"]
        if self._wg_serves(x, wq, scales, biases, chosen):
            return "qmm_wg" if self._repacked(chosen) else "qmm_wg_direct"
        if x.shape[0] >= chosen.get("TC_MIN_ROWS", TC_NEVER) and self._tc.serves(x, wq, scales, biases):
            return "qmv_tc"
        if x.shape[0] <= chosen["QMV_MAX_ROWS"] and 32 % bits == 0:
            if chosen["GEMV"] == "qmv_il":
                return "qmv_il"
            return "qmv_h2" if chosen["GEMV"] == "qmv_h2" and bits in self._h2.BITS_SERVED else "qmv"
        if 32 % bits == 0 and takes_dequant_mm(x, wq, scales, biases):
            return "dequant_mm"
        return "qmm"

    def serves(self, path: str, x, wq, scales, biases) -> bool:
        """Whether `path` can multiply this call at all (not whether it is fast)."""
        bits = self._qm._format_of(x, wq, scales, biases)["BITS"]
        if path in ("qmv", "qmv_il"):
            return 32 % bits == 0
        if path == "qmv_h2":
            return 32 % bits == 0 and bits in self._h2.BITS_SERVED
        if path == "qmv_tc":
            return self._tc.serves(x, wq, scales, biases)
        if path in ("qmm_wg_direct", "qmm_wg"):   # all of x's rows in one program, up to 64
            return x.shape[0] <= WG_KERNEL_MAX_ROWS and self._wg.takes(x, wq, scales, biases)
        if path == "dequant_mm":
            return x.is_cuda and 32 % bits == 0
        return path == "qmm"

    def server_of_path(self, path: str, x, wq, scales, biases, backend: str | None = None):
        """`path`'s call as a function of (x, wq, scales, biases), for weights like wq and x's row count."""
        qm = self._qm
        if not self.serves(path, x, wq, scales, biases):
            raise ValueError(f"qmatmul path {path!r} does not serve {x.shape[0]} {x.dtype} rows of a "
                             f"{tuple(wq.shape)} weight; paths: {', '.join(PATHS)}")
        if path == "qmm_wg":
            # the repacked copy, where memory allows and not first asked inside a graph capture
            if (op := self._wgr.operand_for(wq, scales, biases)) is not None:
                return self._wgr.server_of(op, backend)
            path = "qmm_wg_direct"
        if path == "qmm_wg_direct":
            return self._wg.server_of(x, wq, backend)
        if path == "qmv_tc":
            return lambda x, wq, scales, biases: self._tc.run_qmv_tc(x, wq, scales, biases, backend=backend)
        if path == "qmv_il":
            return lambda x, wq, scales, biases: self._il.run_qmv_il(x, wq, scales, biases, backend=backend)
        if path in ("qmv", "qmv_h2"):
            f = qm._format_of(x, wq, scales, biases)
            prep, gemv = (self._h2.qmv_h2_prep, self._h2.qmv_h2) if path == "qmv_h2" else (qm.qmv_prep, qm.qmv)

            def gemv_call(x, wq, scales, biases):
                y = gemv(*prep(x, PER=32 // f["BITS"], GROUP=f["GROUP"], backend=backend), wq, scales, biases,
                         backend=backend)
                return y if y.dtype == x.dtype else y.to(x.dtype)
            return gemv_call
        if path == "dequant_mm":
            return qm.dequant_mm
        return lambda x, wq, scales, biases: qm.qmm(x, wq, scales, biases, backend=backend)

    def _wg_serves(self, x, wq, scales, biases, chosen: dict) -> bool:
        wg_rows = chosen.get("WG_MIN_ROWS", WG_NEVER) if os.environ.get("KILNX_WG") != "0" else WG_NEVER  # 0: an A/B
        return wg_rows <= x.shape[0] <= WG_MAX_ROWS and self._wg.takes(x, wq, scales, biases)

    @staticmethod
    def _repacked(chosen: dict) -> bool:
        """KILNX_WG=1: the repacked copy for every weight the wgmma kernels take; =direct: for none (A/Bs)."""
        env = os.environ.get("KILNX_WG")
        return env == "1" or (env != "direct" and chosen.get("WG_REPACKED", False))

    def choice_for(self, x, wq, scales, biases) -> dict:
        """The stored choice for this device, weight and row count: the thresholds (`thresholds_for`) and,
        for up to qmatmul_path.MAX_ROWS rows, the per-row-count `PATH` (kernels/qmatmul_path.py)."""
        thresholds = self.thresholds_for(x, wq, scales, biases)
        from kilnx.kernels.qmatmul_path import MAX_ROWS, qmatmul_path
        if x.shape[0] > MAX_ROWS:
            return thresholds
        return {**thresholds, "PATH": qmatmul_path.path_for(x, wq, scales, biases)}

    def thresholds_for(self, x, wq, scales, biases) -> dict:
        """The stored thresholds for this device and weight (the default where none was tuned), looked up
        once per (device, weight shape) until the runtime reloads tuned configs: qmatmul asks per call."""
        memo = (x.device, x.shape[1], wq.shape, scales.shape, _tuning_generation[0])   # a list, bumped in place
        got = self._chosen.get(memo)
        if got is None:
            from kilnx.runtime.dispatch import config_for
            got = self._chosen[memo] = config_for(self, (x, wq, scales, biases), {})
        return got


qmatmul_rows = QmatmulRowsRoute()
