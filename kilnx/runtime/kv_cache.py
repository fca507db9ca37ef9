"""Static KV cache: per layer, k and v tensors (B, Hk, S_max, D) allocated once.

Static because a CUDA graph replays fixed addresses: the decode step writes into the same buffers
every time, at positions given by a tensor. A key for position p lives at index p, so attention's
causal mask (keys j <= position) is also what hides the unwritten tail.

`--kv-cache-dtype fp8` stores K and V as fp8 e4m3 (torch.float8_e4m3fn), half the bytes of bf16: twice the
sequences x context in the same memory, and half the bytes a long-context decode step's attention reads. Values are
rounded to nearest and saturate at +-448 with a scale of 1 (as vLLM's `fp8` without calibrated scales; SmolLM2-135M's
keys stay below 448, tests/runtime/test_kv_cache_dtype.py); the attention kernels widen them to the queries' dtype
as they load.
"""

from __future__ import annotations

import torch

from kilnx.models.config import ModelConfig


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for `--kv-cache-dtype name`: auto = the model's activation dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


class KVCache:
    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k = k
        self.v = v

    @classmethod
    def allocate(cls, num_layers: int, batch: int, num_kv_heads: int, max_seq: int, head_dim: int, *,
                 dtype=torch.float32, device="cpu") -> "KVCache":
        shape = (batch, num_kv_heads, max_seq, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v)

    @classmethod
    def for_model(cls, cfg: ModelConfig, batch: int, max_seq: int, *, dtype=torch.float32,
                  device="cpu") -> "KVCache":
        return cls.allocate(cfg.num_layers, batch, cfg.num_kv_heads, max_seq, cfg.head_dim,
                            dtype=dtype, device=device)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Bytes of K and V one position occupies for one sequence, across all layers."""
        t = self.k[0]
        return 2 * len(self.k) * t.shape[1] * t.shape[3] * t.element_size()

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of sequences [start, stop): prefill one sequence into a batched cache."""
        return KVCache([t[start:stop] for t in self.k], [t[start:stop] for t in self.v])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of sequence src's K and V into sequence dst (a shared prompt prefix, reused)."""
        self.copy_prefix_from(self, src, dst, n)

    def copy_prefix_from(self, other: "KVCache", src: int, dst: int, n: int) -> None:
        """Positions [0, n) of `other`'s sequence src into this cache's sequence dst (same layers and heads)."""
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            mine[dst, :, :n].copy_(theirs[src, :, :n])
