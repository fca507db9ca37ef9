"""Embedding lookup as a kernel: out[t] = table[ids[t]].

Why a kernel for a gather: every piece of a decode step that writes data is then a kernel launch, so
the CPU engine can record a step's launches once and replay them (kilnx/runtime/engine.py); a torch
gather in the middle of the step would not be replayed.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd


def _spec(table, ids, **_):
    return table[ids.long()]


@kd.kernel(tune={"BLOCK": kd.pow2(64, 4096, default=1024), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda table, ids, **_: {"T": ids.shape[0], "H": table.shape[1]}, spec=_spec)
def embedding_kernel(table, ids, *, BLOCK):
    V, H = table.shape
    T = ids.shape[0]
    t, pb = kd.grid(T, kd.cdiv(H, BLOCK))
    cols = pb * BLOCK + kd.arange(0, BLOCK)
    row = kd.load(ids, t, check=False)
    out = kd.output((T, H), table.dtype)
    kd.store(out, t, cols, kd.load(table, row, cols, check=(False, True)))
    return out


def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return embedding_kernel(table, ids.reshape(-1))


def _args(problem: dict, device: str):
    table = torch.randn(1000, problem["H"]).to(device)
    return table, torch.randint(0, 1000, (problem["T"],)).to(device)


embedding_kernel.tuning(make_args=_args, problems=[{"T": 1, "H": 4096}])
