"""Random weights at a preset's real size, for benchmarks: dense bf16 or MLX 4-bit (groups of 64).

Quantized weights are generated directly as random packed words plus scales and biases, so an 8B
model does not have to be created dense and quantized on the CPU first. Magnitudes are chosen so
activations stay O(1) through the layers (weights ~ 1/sqrt(K)), which keeps softmax and sampling
on realistic code paths.
"""

from __future__ import annotations

import re

import torch

from kilnx.models.config import ModelConfig

FORMATS = ("bf16", "q4")
_LAYER_RE = re.compile(r"model\.layers\.\d+\.(.+)")


class RandomSource:
    def __init__(self, cfg: ModelConfig, *, fmt: str = "q4", device="cpu", dtype=torch.bfloat16, seed: int = 0):
        if fmt not in FORMATS:
            raise ValueError(f"random weight format {fmt!r}: use one of {FORMATS}")
        self.path = f"<random {fmt} {cfg.name or cfg.arch}>"
        self.cfg, self.fmt, self.device, self.dtype = cfg, fmt, torch.device(device), dtype
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def _shape(self, name: str) -> tuple[int, ...]:
        c = self.cfg
        if c.is_hybrid:
            got = self._hybrid(name)
            return got if isinstance(got, tuple) else tuple(got.shape)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (c.vocab_size, c.hidden_size)
        if name == "model.norm.weight":
            return (c.hidden_size,)
        rest = _LAYER_RE.fullmatch(name).group(1)
        shapes = {
            "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            "self_attn.q_proj.bias": (c.q_size,), "self_attn.k_proj.bias": (c.kv_size,),
            "self_attn.v_proj.bias": (c.kv_size,),
            "self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,),
            "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            f"{c.moe_block}.gate.weight": (c.num_experts, c.hidden_size),
            f"{c.moe_block}.switch_mlp.gate_proj.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
            f"{c.moe_block}.switch_mlp.up_proj.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
            f"{c.moe_block}.switch_mlp.down_proj.weight": (c.num_experts, c.hidden_size, c.moe_intermediate_size),
        }
        return shapes.get(rest, (c.hidden_size,))   # the remaining per-layer tensors are norms

    def has(self, name: str) -> bool:
        if name == "lm_head.weight":
            return not self.cfg.tie_embeddings
        if name == "rope_freqs" or ".experts." in name:    # experts come as stacks (switch_mlp)
            return False
        return True

    def _randn(self, shape, std: float, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype).mul_(std)

    def _hybrid(self, name: str):
        from kilnx.models.hybrid_weights import random_hybrid_tensor
        return random_hybrid_tensor(self.cfg, name, lambda shape, std: self._randn(shape, std))

    def dense(self, name: str) -> torch.Tensor:
        got = self._hybrid(name) if self.cfg.is_hybrid else None   # a hybrid's mixer parameters come as values
        if isinstance(got, torch.Tensor):
            return got.to(self.device)
        shape = got or self._shape(name)
        if len(shape) == 2:                      # the embedding table
            return self._randn(shape, 1.0, self.dtype)
        if name.endswith(".bias"):
            return self._randn(shape, 0.02)
        base = 1.0 - self.cfg.norm_weight_offset  # norms: 1 + noise in the effective weight
        return self._randn(shape, 0.05).add_(base)

    def linears(self, names: list[str]) -> list:
        return [self._linear(self._shape(n)) for n in names]

    def _linear(self, shape):
        *lead, n, k = shape            # a leading expert axis for the MoE stacks
        std = k ** -0.5
        if self.fmt == "bf16":
            if lead:
                raise ValueError("random MoE experts are quantized stacks: use the q4 format")
            return self._randn(shape, std, torch.bfloat16 if self.dtype == torch.float32 else self.dtype)
        from kilnx.quant import QWeight
        gs, bits = 64, 4
        packed = torch.randint(-2**31, 2**31, (*lead, n, k * bits // 32), generator=self.gen, device=self.device,
                               dtype=torch.int64).to(torch.int32)
        # Uniform codes 0..15 have std ~4.6; scale so weights have std ~1/sqrt(K), centred on zero.
        scale_dtype = torch.float32 if self.dtype == torch.float32 else self.dtype
        scales = torch.full((*lead, n, k // gs), std / 4.6, device=self.device, dtype=scale_dtype)
        biases = scales * -7.5
        return QWeight.from_mlx(packed, scales, biases, bits=bits, group_size=gs)
