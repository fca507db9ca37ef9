"""The MoE router's top-k: softmax over the experts, the k largest probabilities, optionally renormalized; or
DeepSeek-V3's sigmoid form (moe_topk_sigmoid) that nemotron-3's MoE layers use.

One program takes ROWS tokens' router logits (a whole row of E experts each), so the softmax and the
k selections never leave registers: each selection is a max, then the lowest index holding it (ties go
to the lower expert, as a stable descending sort would), then that lane is knocked out. This is
qwen3-moe's and mixtral's routing (mlx-lm: softmax, argpartition, take, divide by the sum when
norm_topk_prob); weights come out in fp32, as the MoE kernels read them.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd


def _spec(logits, *, TOP_K, NORM, **_):
    from kilnx.ops_torch import moe_route
    return moe_route(logits, TOP_K, NORM)


def _specialize(logits):
    return {"BLOCK_E": 1 << max(int(logits.shape[1]) - 1, 0).bit_length()}


@kd.kernel(tune={"ROWS": kd.pow2(1, 16, default=1), "num_warps": kd.choice(1, 2, 4, default=1)},
           key=lambda logits, **kw: {"E": logits.shape[1], "k": kw["TOP_K"], "rows": logits.shape[0]},
           spec=_spec, specialize=_specialize)
def moe_topk(logits, *, TOP_K: kd.constexpr, NORM: kd.constexpr, BLOCK_E: kd.constexpr, ROWS):
    """logits (T, E) -> (expert ids (T, TOP_K) int32, routing weights (T, TOP_K) fp32)."""
    T, E = logits.shape
    pid = kd.grid(kd.cdiv(T, ROWS))
    r = pid * ROWS + kd.arange(0, ROWS)
    e = kd.arange(0, BLOCK_E)[None, :]
    live = e < E
    v = kd.where(live, kd.load(logits, r[:, None], e, check=(True, True)).f32(), -3.0e38)
    p = kd.where(live, kd.exp(v - kd.max(v, axis=1)[:, None]), 0.0)
    total = kd.sum(p, axis=1)
    left = kd.where(live, p, -1.0)                  # padding lanes are never picked
    ids = kd.output((T, TOP_K), kd.i32, name="expert_ids")
    weights = kd.output((T, TOP_K), kd.f32, name="routing_weights")
    picked = _choose(left, e, r, ids, TOP_K, BLOCK_E, knocked=-1.0)
    norm = _total(picked) if NORM else total
    for j in kd.static_range(TOP_K):
        kd.store(weights, r, j, picked[j] / norm, check=(True, False))
    return ids, weights


def _choose(left, e, r, ids, TOP_K: int, BLOCK_E: int, *, knocked: float, weigh=None) -> list:
    """The TOP_K largest lanes of `left` per row, ties to the lower expert (each taken lane set to `knocked`): their
    ids stored into ids[r, j]; returned, each one's value of `left`, or of `weigh` where given."""
    picked = []
    for j in kd.static_range(TOP_K):
        best = kd.max(left, axis=1)
        idx = kd.min(kd.where(left == best[:, None], e, BLOCK_E), axis=1)
        kd.store(ids, r, j, idx, check=(True, False))
        chosen = e == idx[:, None]
        picked.append(best if weigh is None else kd.sum(kd.where(chosen, weigh, 0.0), axis=1))
        left = kd.where(chosen, knocked, left)
    return picked


def _total(picked: list):
    total = picked[0]
    for j in kd.static_range(1, len(picked)):
        total = total + picked[j]
    return total


def _sigmoid_spec(logits, bias, *, TOP_K, NORM, SCALE, **_):
    from kilnx.ops_torch import moe_route
    return moe_route(logits, TOP_K, NORM, scoring="sigmoid", bias=bias, scale=SCALE)


# A knocked-out or padding lane: below any sigmoid score plus a correction bias
_NEVER = -3.0e38


@kd.kernel(tune={"ROWS": kd.pow2(1, 16, default=1), "num_warps": kd.choice(1, 2, 4, default=1)},
           key=lambda logits, bias, **kw: {"E": logits.shape[1], "k": kw["TOP_K"], "rows": logits.shape[0]},
           spec=_sigmoid_spec, specialize=lambda logits, bias: _specialize(logits))
def moe_topk_sigmoid(logits, bias, *, TOP_K: kd.constexpr, NORM: kd.constexpr, SCALE: float, BLOCK_E: kd.constexpr,
                     ROWS):
    """logits (T, E), bias (E,) -> (expert ids (T, TOP_K) int32, weights (T, TOP_K) fp32): the experts chosen by
    sigmoid(logit) + bias (the correction bias steers the choice only), weighted by their sigmoid scores,
    divided by the scores' sum (+1e-20) when NORM, times SCALE (routed_scaling_factor)."""
    T, E = logits.shape
    pid = kd.grid(kd.cdiv(T, ROWS))
    r = pid * ROWS + kd.arange(0, ROWS)
    e = kd.arange(0, BLOCK_E)[None, :]
    live = e < E
    score = kd.sigmoid(kd.load(logits, r[:, None], e, check=(True, True)).f32())
    left = kd.where(live, score + kd.load(bias, e, check=True).f32(), _NEVER)
    ids = kd.output((T, TOP_K), kd.i32, name="expert_ids")
    weights = kd.output((T, TOP_K), kd.f32, name="routing_weights")
    picked = _choose(left, e, r, ids, TOP_K, BLOCK_E, knocked=_NEVER, weigh=score)
    norm = (_total(picked) + 1e-20) / SCALE if NORM else 1.0 / SCALE
    for j in kd.static_range(TOP_K):
        kd.store(weights, r, j, picked[j] / norm, check=(True, False))
    return ids, weights


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool, *, scoring: str = "softmax",
              bias: torch.Tensor | None = None, scale: float = 1.0):
    """kilnx.ops.moe_route: router logits (T, E) -> (expert ids (T, top_k) int32, weights (T, top_k) fp32)."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: logits must be (tokens, experts) with 0 < top_k <= experts; got "
                         f"{tuple(logits.shape)} and top_k {top_k}")
    if scoring == "softmax":
        if bias is not None or scale != 1.0:
            raise ValueError("moe_route: a correction bias and a scale go with scoring='sigmoid'")
        return moe_topk(logits, TOP_K=int(top_k), NORM=bool(normalize))
    if scoring != "sigmoid":
        raise ValueError(f"moe_route: scoring {scoring!r} is not known; use 'softmax' or 'sigmoid'")
    if bias is None:
        bias = torch.zeros(logits.shape[1], dtype=torch.float32, device=logits.device)
    if bias.shape != (logits.shape[1],):
        raise ValueError(f"moe_route: bias {tuple(bias.shape)} is not one value per expert ({logits.shape[1]})")
    return moe_topk_sigmoid(logits, bias, TOP_K=int(top_k), NORM=bool(normalize), SCALE=float(scale))
