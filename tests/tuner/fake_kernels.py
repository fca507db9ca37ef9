"""Fake kernels for tuner tests: plain torch on CPU, implementing the DSL kernel protocol.

Their run time is a busy-wait whose length depends on the config, so the best config is known
(BLOCK=16, and `unroll` shaves a little) while each call stays in the tens of microseconds.
"""

from __future__ import annotations

import os
import time

import torch

from kilnx.dsl.tunables import Space, boolean, choice, pow2

_US = 1e-6


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _cost_us(block: int, unroll: bool) -> float:
    # 20 us per power-of-two step away from 16, +10 us without unroll: default (block=4) costs ~50 us.
    return 10.0 + 20.0 * abs(block.bit_length() - 5) + (0.0 if unroll else 10.0)


class ScaleAddKernel:
    """y = 2x + 1 over a (M, N) fp32 input."""

    name = "fake_scale_add"
    source_hash = "fakescaleadd0001"

    def __init__(self, modes: tuple[str, ...] = ("ok",), source_hash: str | None = None, default_block: int = 4,
                 default_unroll: bool = False, compile_s: float = 0.0):
        params = {"BLOCK": pow2(1, 64, default=default_block), "unroll": boolean(default_unroll)}
        self.modes = modes
        self.compile_s = compile_s
        if len(modes) > 1:
            params["mode"] = choice(*modes, default="ok")
        # BLOCK=64 with unroll is declared invalid, to exercise pruning before compile.
        self.space = Space(params, constraints=(lambda BLOCK, unroll: not (BLOCK == 64 and unroll),))
        self.compiled: list[dict] = []  # configs compiled in this process (tests look at it)
        if source_hash:
            self.source_hash = source_hash

    def key(self, x):
        return f"M={x.shape[0]},N={x.shape[1]}"

    def default_config(self, *args):
        return self.space.default()

    def sample_problems(self):
        return [{"M": 4, "N": 64}, {"M": 8, "N": 64}]

    def make_args(self, problem, device):
        # The tuner seeds torch before each call; trials use seeds below GATE_SEED (their trial
        # number), so this log tells tests how many trials workers evaluated.
        log = os.environ.get("KILNX_FAKE_EVAL_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{torch.initial_seed()}\n")
        return (torch.rand(problem["M"], problem["N"], device=device) + 0.5,)

    def reference(self, x):
        return torch.from_numpy(x.cpu().numpy() * 2.0 + 1.0)

    def compile(self, config, *args):
        cfg = self.space.validate(config)
        assert self.space.is_valid(cfg), "the tuner compiled a config that breaks a constraint"
        self.compiled.append(cfg)
        mode = cfg.get("mode", "ok")
        if self.compile_s:
            time.sleep(self.compile_s)
        if mode == "raise":
            raise RuntimeError("fake compile error: too many registers")
        if mode == "oom":
            raise torch.OutOfMemoryError("fake: out of memory")
        if mode == "crash":
            os._exit(7)
        cost = _cost_us(cfg["BLOCK"], cfg["unroll"]) * _US

        def fn(x):
            if mode == "hang":
                time.sleep(60)
            _spin(cost)
            y = x * 2.0 + 1.0
            if mode == "wrong":
                y[0, 0] += 0.5
            if mode == "nan":
                y[-1, -1] = float("nan")
            if mode == "partial":  # never writes the last row: only the poison could be there
                out = torch.empty_like(x)
                out[:-1] = y[:-1]
                return out
            return y
        return fn

    def seed_configs(self, problem):
        # The faulty variant seeds one config per failure mode, so each is sure to be tried.
        bad = [{"BLOCK": 16, "unroll": True, "mode": m} for m in self.modes if m != "ok"]
        return bad or [{"BLOCK": 8, "unroll": True}]

    def peer(self, x):
        _spin(40 * _US)
        return x * 2.0 + 1.0


def _named(kernel: ScaleAddKernel, name: str) -> ScaleAddKernel:
    kernel.name = name
    return kernel


scale_add = ScaleAddKernel()
# Every failure mode a candidate can have; only "ok" configs may be recorded.
FAULTY_MODES = ("ok", "raise", "oom", "crash", "hang", "wrong", "nan", "partial")
faulty = _named(ScaleAddKernel(modes=FAULTY_MODES), "fake_faulty")
# The default (BLOCK=16, unroll) is the fastest config: the tuner must record the default.
default_best = _named(ScaleAddKernel(default_block=16, default_unroll=True), "fake_default_best")
# Each compile takes 0.3 s: slow enough to kill a tune mid-way.
slow = _named(ScaleAddKernel(compile_s=0.3), "fake_slow")


class GpuScaleAddKernel(ScaleAddKernel):
    """The same y = 2x + 1 whose cost on CUDA is wasted matmul work (a host busy-wait would not be
    captured in a CUDA graph): BLOCK=16 does the least."""

    name = "fake_gpu_scale_add"

    def compile(self, config, *args):
        cfg = self.space.validate(config)
        x = args[0]
        if not x.is_cuda:
            return super().compile(config, *args)
        n = 512 * (1 + abs(cfg["BLOCK"].bit_length() - 5)) + (0 if cfg["unroll"] else 256)
        scratch = torch.rand(n, n, device=x.device)

        def fn(x):
            torch.mm(scratch, scratch)  # the cost of this config
            return x * 2.0 + 1.0
        return fn

    def sample_problems(self):
        return [{"M": 64, "N": 4096}]


gpu_scale_add = GpuScaleAddKernel()


class ConsumerKernel(ScaleAddKernel):
    """y = 2x + 1 whose one config runs fast only where the tuning DB this process loaded says scale_add's
    M=4,N=64 bucket is tuned to BLOCK=16: a route, whose time depends on the configs of the kernels it calls."""

    name = "fake_consumer"
    source_hash = "fakeconsumer0001"

    def __init__(self):
        super().__init__()
        self.space = Space({"BLOCK": choice(1, default=1)})

    def seed_configs(self, problem):
        return []

    def compile(self, config, *args):
        from kilnx.runtime import dispatch
        from kilnx.runtime.device import detect
        seen = dispatch.get_tuned(detect("cpu")).config_for(scale_add.name, scale_add.source_hash, "M=4,N=64", {})
        cost = (10 if seen.get("BLOCK") == 16 else 200) * _US

        def fn(x):
            _spin(cost)
            return x * 2.0 + 1.0
        return fn


consumer = ConsumerKernel()
