"""Which implementation of the ops a model calls: the DSL kernels (kilnx.ops) or the torch-eager peer.

`resolve_ops` accepts a module, "kilnx", "torch", or "auto" (kilnx.ops, falling back per op to
kilnx.ops_torch while a kernel has not landed). Default: $KILNX_OPS, else "kilnx".
"""

from __future__ import annotations

import os
import sys
import types

import torch

OP_NAMES = ("embedding", "rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "softcap", "scaled_add", "rope_",
            "rope_and_cache_", "qmatmul", "attention", "attention_new_tokens", "argmax", "moe_route", "moe",
            "relu2", "conv1d_silu_", "ssm_scan_", "gated_rms_norm")
# fusions only the kernels have (a model asks prepared_format first, and without them calls the plain ops)
KILNX_ONLY = ("prepared_format", "add_rms_norm_prepared", "silu_mul_prepared", "swiglu_prepared", "fuses_qkv_rope",
              "qkv_rope_cache", "qk_norm_rope_cache_")


class _FallbackOps(types.SimpleNamespace):
    """kilnx.ops where its kernel exists, kilnx.ops_torch for ops that raise ImportError/NotImplementedError."""

    NAME = "auto"

    def __init__(self):
        import kilnx.ops as kops
        import kilnx.ops_torch as tops
        fns = {name: self._wrap(name, getattr(kops, name), getattr(tops, name)) for name in OP_NAMES}
        fns.update({name: getattr(kops, name) for name in KILNX_ONLY})
        super().__init__(**fns)
        self.fell_back: set[str] = set()

    def _wrap(self, name, primary, fallback):
        def call(*args, **kwargs):
            if name in self.fell_back:
                return fallback(*args, **kwargs)
            try:
                return primary(*args, **kwargs)
            except (ImportError, NotImplementedError, AttributeError) as e:
                self.fell_back.add(name)
                print(f"kilnx: op {name} has no kernel yet ({type(e).__name__}); using torch eager for it.",
                      file=sys.stderr)
                return fallback(*args, **kwargs)
        call.__name__ = name
        return call


def resolve_ops(ops=None):
    if ops is None:
        ops = os.environ.get("KILNX_OPS", "kilnx")
    if not isinstance(ops, str):
        return ops
    key = ops.strip().lower()
    if key in ("torch", "ops_torch", "eager"):
        import kilnx.ops_torch as tops
        return tops
    if key in ("kilnx", "ops", "dsl"):
        import kilnx.ops as kops
        return kops
    if key == "auto":
        return _FallbackOps()
    raise ValueError(f"unknown ops backend {ops!r}; use kilnx, torch or auto.")


def ops_name(ops) -> str:
    return getattr(ops, "NAME", None) or getattr(ops, "__name__", type(ops).__name__)


def missing_ops(ops, device: str = "cpu") -> list[str]:
    """Names of ops that cannot run yet on `device` (kernel not landed): tiny probe calls of each."""
    dev = torch.device(device)
    x = torch.randn(2, 64, device=dev)
    w = torch.ones(64, device=dev)
    q = torch.randn(1, 2, 2, 64, device=dev)
    kc = torch.randn(1, 1, 4, 64, device=dev)
    pos = torch.tensor([[2, 3]], device=dev)
    probes = {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "add_rms_norm": lambda: ops.add_rms_norm(x, x, w, 1e-6),
        "silu_mul": lambda: ops.silu_mul(x),
        "gelu_tanh_mul": lambda: ops.gelu_tanh_mul(x),
        "softcap": lambda: ops.softcap(x, 30.0),
        "scaled_add": lambda: ops.scaled_add(x, x, 0.5),
        "rope_": lambda: ops.rope_(q[0].clone(), kc[0, :, :2].transpose(0, 1).contiguous(), pos[0],
                                   torch.ones(32, device=dev)),
        "rope_and_cache_": lambda: ops.rope_and_cache_(q[0].clone(), q[0, :, :1].clone(), q[0, :, :1].clone(),
                                                       pos[0], torch.zeros_like(pos[0]), torch.ones(32, device=dev),
                                                       kc.clone(), kc.clone()),
        "qmatmul": lambda: ops.qmatmul(x, torch.randn(32, 64, device=dev)),
        "attention": lambda: ops.attention(q, kc, kc, pos, 0.125),
        "attention_new_tokens": lambda: ops.attention_new_tokens(
            q[0].clone(), q[0, :, :1].clone(), q[0, :, :1].clone(), pos, torch.zeros_like(pos[0]),
            torch.ones(32, device=dev), kc.clone(), kc.clone(), 0.125),
        "argmax": lambda: ops.argmax(x),
    }
    out = []
    for name, fn in probes.items():
        try:
            fn()
        except (ImportError, NotImplementedError, AttributeError):
            out.append(name)
    return out
