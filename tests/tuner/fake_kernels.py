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

    def __init__(self, modes: tuple[str, ...] = ("ok",), source_hash: str | None = None):
        params = {"BLOCK": pow2(1, 64, default=4), "unroll": boolean(False)}
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
        return (torch.rand(problem["M"], problem["N"], device=device) + 0.5,)

    def reference(self, x):
        return torch.from_numpy(x.cpu().numpy() * 2.0 + 1.0)

    def compile(self, config, *args):
        cfg = self.space.validate(config)
        assert self.space.is_valid(cfg), "the tuner compiled a config that breaks a constraint"
        self.compiled.append(cfg)
        mode = cfg.get("mode", "ok")
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
        return [{"BLOCK": 8, "unroll": True}]

    def peer(self, x):
        _spin(40 * _US)
        return x * 2.0 + 1.0


scale_add = ScaleAddKernel()
# Every failure mode a candidate can have; "ok" is the default and must win.
faulty = ScaleAddKernel(modes=("ok", "raise", "oom", "crash", "hang", "wrong", "nan"))
faulty.name = "fake_faulty"
