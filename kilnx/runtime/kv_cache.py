"""Static KV cache: per layer, k and v tensors (B, Hk, S_max, D) allocated once.

Static because a CUDA graph replays fixed addresses: the decode step writes into the same buffers
every time, at positions given by a tensor. A key for position p lives at index p, so attention's
causal mask (keys j <= position) is also what hides the unwritten tail.

An engine's cache has one slot more than its context: the parking slot (`park`, the last). A row that rides
along in a step without a token of its own (a free or still prefilling row in a batched decode step, a prompt's
padding to a CUDA graph's length) takes that position: it writes its junk K/V there, where no real token ever
lives, the attention kernels skip its keys (it attends to nothing: one cache-long walk a parked row a layer before),
and the SSM kernels leave its recurrent state as it was. A cache without `park` (None) holds tokens in every slot.

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


def _slots(max_seq: int, park: bool) -> tuple[int, int | None]:
    """(slots to allocate, the parking slot or None) for a context of max_seq tokens."""
    return (max_seq + 1, max_seq) if park else (max_seq, None)


class KVCache:
    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], park: int | None = None):
        self.k = k
        self.v = v
        self.park = park    # the parking slot (module doc), or None

    @classmethod
    def allocate(cls, num_layers: int, batch: int, num_kv_heads: int, max_seq: int, head_dim: int, *,
                 dtype=torch.float32, device="cpu", park: bool = False) -> "KVCache":
        """Caches for max_seq tokens a row; `park`: one slot more, the parking slot."""
        slots, park_at = _slots(max_seq, park)
        shape = (batch, num_kv_heads, slots, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v, park_at)

    @classmethod
    def for_model(cls, cfg: ModelConfig, batch: int, max_seq: int, *, dtype=torch.float32,
                  device="cpu", park: bool = False) -> "KVCache":
        return cls.allocate(cfg.num_layers, batch, cfg.num_kv_heads, max_seq, cfg.head_dim,
                            dtype=dtype, device=device, park=park)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def slots(self) -> int:
        """Positions a row holds: the context, and the parking slot where there is one."""
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
        return KVCache([t[start:stop] for t in self.k], [t[start:stop] for t in self.v], self.park)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of sequence src's K and V into sequence dst (a shared prompt prefix, reused)."""
        self.copy_prefix_from(self, src, dst, n)

    def copy_prefix_from(self, other: "KVCache", src: int, dst: int, n: int) -> None:
        """Positions [0, n) of `other`'s sequence src into this cache's sequence dst (same layers and heads)."""
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            mine[dst, :, :n].copy_(theirs[src, :, :n])


class HybridCache(KVCache):
    """A hybrid model's cache (models/hybrid.py): K and V for its attention layers, and for each Mamba-2 layer the
    recurrent state of every row, conv (B, K-1, C) in the activation dtype and ssm (B, H, P, N) fp32. Lists are
    indexed by layer, None where a layer has no such part.

    A row's state sums its whole history, so it cannot be cut back to a prefix: no prefix copies between rows (a
    prompt either continues its row's whole history or restarts from position 0, where the kernels begin from a zero
    state), and nothing may run a token into a row that is not its next one but padding at the parking slot, which
    leaves the state as it was (runtime/engine.py: no speculative rounds)."""

    def __init__(self, k: list, v: list, conv: list, ssm: list, slots: int, park: int | None = None):
        super().__init__(k, v, park)
        self.conv, self.ssm, self._slots = conv, ssm, slots     # kept: a model of Mamba layers only has no K

    @classmethod
    def for_hybrid(cls, cfg: ModelConfig, batch: int, max_seq: int, *, dtype=torch.float32, state_dtype=None,
                   device="cpu", park: bool = False) -> "HybridCache":
        kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
        slots, park_at = _slots(max_seq, park)
        kv = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
        k = [torch.zeros(kv, dtype=dtype, device=device) if t == "attention" else None for t in kinds]
        v = [torch.zeros(kv, dtype=dtype, device=device) if t == "attention" else None for t in kinds]
        conv_shape = (batch, cfg.conv_kernel - 1, cfg.conv_dim)
        ssm_shape = (batch, cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
        conv = [torch.zeros(conv_shape, dtype=state_dtype or dtype, device=device) if t == "mamba" else None
                for t in kinds]
        ssm = [torch.zeros(ssm_shape, dtype=torch.float32, device=device) if t == "mamba" else None for t in kinds]
        return cls(k, v, conv, ssm, slots, park_at)

    def _present(self, tensors: list) -> list:
        return [t for t in tensors if t is not None]

    @property
    def batch(self) -> int:
        return (self._present(self.k) or self._present(self.ssm))[0].shape[0]

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._present(self.k + self.v + self.conv + self.ssm))

    @property
    def state_nbytes_per_row(self) -> int:
        """The recurrent state's bytes for one sequence, whatever its length."""
        return sum(t[0].numel() * t.element_size() for t in self._present(self.conv + self.ssm))

    def bytes_per_token(self) -> int:
        ks = self._present(self.k)
        return 2 * len(ks) * ks[0].shape[1] * ks[0].shape[3] * ks[0].element_size() if ks else 0

    def rows(self, start: int, stop: int) -> "HybridCache":
        def cut(ts):
            return [t[start:stop] if t is not None else None for t in ts]
        return HybridCache(cut(self.k), cut(self.v), cut(self.conv), cut(self.ssm), self._slots, self.park)

    def save_state(self) -> list:
        """A copy of every row's recurrent state, for restore_state: a step that must run twice from the same
        state (the CPU engine's recording of its first step)."""
        return [t.clone() for t in self._present(self.conv + self.ssm)]

    def restore_state(self, saved: list) -> None:
        for t, s in zip(self._present(self.conv + self.ssm), saved):
            t.copy_(s)

    def copy_prefix_from(self, other, src: int, dst: int, n: int) -> None:
        raise NotImplementedError("a hybrid model's rows hold recurrent state, which cannot be cut back to a prefix: "
                                  "prefix reuse between rows is off for it.")
