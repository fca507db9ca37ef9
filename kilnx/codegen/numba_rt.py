"""Helpers the generated numba code calls: memory access with masks, 16-bit float conversion,
reductions by axis (numba's numpy subset lacks several axis/keepdims forms)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_NJ = dict(cache=True, nogil=True)


@njit(**_NJ)
def bf16_bits_to_f32(u):
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


@njit(**_NJ)
def f32_to_bf16_bits(x):
    b = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
    r = (b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return r.astype(np.uint16)


@njit(**_NJ)
def round_bf16(x):
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    flat = a.ravel()
    return bf16_bits_to_f32(f32_to_bf16_bits(flat)).reshape(a.shape)


@njit(**_NJ)
def round_f16(x):
    return np.asarray(x).astype(np.float16).astype(np.float32)


@njit(**_NJ)
def erf(x):
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    flat = a.ravel().copy()
    for i in range(flat.size):
        flat[i] = math.erf(flat[i])
    return flat.reshape(a.shape)


@njit(**_NJ)
def gather(flat, off, mask, other):
    """flat[off] where mask, else other; off/mask already broadcast to the tile shape."""
    o = off.ravel()
    m = mask.ravel()
    out = np.empty(o.size, dtype=flat.dtype)
    for i in range(o.size):
        out[i] = flat[o[i]] if m[i] else other
    return out.reshape(off.shape)


@njit(**_NJ)
def gather_bf16(flat, off, mask, other):
    bits = gather(flat, off, mask, np.uint16(0))
    vals = bf16_bits_to_f32(np.ascontiguousarray(bits).ravel()).reshape(off.shape)
    return np.where(mask, vals, np.float32(other))


@njit(**_NJ)
def scatter(flat, off, mask, value):
    o = off.ravel()
    m = mask.ravel()
    v = value.ravel()
    for i in range(o.size):
        if m[i]:
            flat[o[i]] = v[i]


@njit(**_NJ)
def scatter_bf16(flat, off, mask, value):
    o = off.ravel()
    m = mask.ravel()
    bits = f32_to_bf16_bits(np.ascontiguousarray(value.ravel()).astype(np.float32))
    for i in range(o.size):
        if m[i]:
            flat[o[i]] = bits[i]


@njit(**_NJ)
def scatter_add(flat, off, mask, value):
    o = off.ravel()
    m = mask.ravel()
    v = value.ravel()
    for i in range(o.size):
        if m[i]:
            flat[o[i]] += v[i]


@njit(**_NJ)
def scatter_add_bf16(flat, off, mask, value):
    o = off.ravel()
    m = mask.ravel()
    v = value.ravel()
    for i in range(o.size):
        if m[i]:
            cur = np.array([np.uint32(flat[o[i]]) << np.uint32(16)]).view(np.float32)
            cur[0] += np.float32(v[i])
            flat[o[i]] = f32_to_bf16_bits(cur)[0]


@njit(**_NJ)
def matmul(a, b):
    """(M, K) @ (K, N) fp32 tiles by loops: numba's np.dot needs scipy's BLAS, not a kilnx dependency."""
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for i in range(a.shape[0]):
        for k in range(a.shape[1]):
            aik = a[i, k]
            for j in range(b.shape[1]):
                out[i, j] += aik * b[k, j]
    return out


# Reductions of 1-d and 2-d tiles. `kind`: 0 sum, 1 max, 2 min.
@njit(**_NJ)
def _combine(kind, a, b):
    if kind == 0:
        return a + b
    if kind == 1:
        return a if a >= b or a != a else b
    return a if a <= b or a != a else b


@njit(**_NJ)
def reduce1(x, kind):
    acc = x[0]
    for i in range(1, x.shape[0]):
        acc = _combine(kind, acc, x[i])
    return acc


@njit(**_NJ)
def reduce2(x, kind, axis):
    if axis == 1:
        out = np.empty(x.shape[0], dtype=x.dtype)
        for i in range(x.shape[0]):
            acc = x[i, 0]
            for j in range(1, x.shape[1]):
                acc = _combine(kind, acc, x[i, j])
            out[i] = acc
        return out
    out = np.empty(x.shape[1], dtype=x.dtype)
    for j in range(x.shape[1]):
        acc = x[0, j]
        for i in range(1, x.shape[0]):
            acc = _combine(kind, acc, x[i, j])
        out[j] = acc
    return out


@njit(**_NJ)
def argmax1(x, sign):
    best, bi = x[0] * sign, 0
    for i in range(1, x.shape[0]):
        if x[i] * sign > best:
            best, bi = x[i] * sign, i
    return np.int32(bi)


@njit(**_NJ)
def argmax2(x, sign, axis):
    if axis == 1:
        out = np.empty(x.shape[0], dtype=np.int32)
        for i in range(x.shape[0]):
            out[i] = argmax1(x[i], sign)
        return out
    out = np.empty(x.shape[1], dtype=np.int32)
    for j in range(x.shape[1]):
        out[j] = argmax1(np.ascontiguousarray(x[:, j]), sign)
    return out
