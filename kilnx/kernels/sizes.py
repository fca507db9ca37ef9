"""Size arithmetic the kernels' launch wrappers share: powers of two for block sizes and for the
divisibility facts that let a kernel drop bounds masks."""

from __future__ import annotations


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def pow2_dividing(n: int, cap: int = 4096) -> int:
    """The largest power of two dividing n (up to cap): a block that divides a dim needs no bounds mask on
    it, which also frees the compiler to vectorize and skip zero-filling."""
    return min(n & -n, cap) if n > 0 else cap


# No parking position: a kernel given it treats every token as real (runtime/kv_cache.py's parking slot). Below
# 2**31 so that it passes as an int32 argument, as a real slot index does (an int64 would compile another variant).
NO_LIMIT = 2 ** 31 - 1
