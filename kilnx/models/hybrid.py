"""Hybrid decoders: nemotron-h, a stack of Mamba-2, attention and MLP layers, each `x + mixer(rms_norm(x))`.

A Mamba-2 layer projects x once into [z | x B C | dt]; x B C goes through a causal depthwise convolution and SiLU,
x is scanned with its heads' states (decay exp(-exp(A_log) * dt), input dt * x ⊗ B, output state · C + D * x), and
the result is normalized per group gated by silu(z) before the out projection (kernels/ssm.py). The attention layers
have no positional rotation (nemotron-h's attention is position-free; the llama path's rope runs with zero
frequencies, an exact identity) and the MLP layers are up -> relu² -> down without a gate.

State is per cache row (runtime/kv_cache.py's HybridCache), so the engine runs a hybrid model only with each row's
tokens in order: see `recurrent`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kilnx.models.config import ModelConfig
from kilnx.models.errors import CheckpointError
from kilnx.models.llama import LlamaModel, _linear
from kilnx.models.weights import ModelWeights, _place, concat_linears, embedding_and_head, gemv_width


@dataclass
class MambaWeights:
    in_proj: list                  # [(I + C + H, hidden)]: z, then x B C, then dt
    conv_weight: torch.Tensor      # (C, K)
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor          # (H,) fp32
    A_log: torch.Tensor            # (H,) fp32
    D: torch.Tensor                # (H,) fp32
    norm: torch.Tensor             # (I,) the gated group norm's weight
    out_proj: object               # Linear (hidden, I)


@dataclass
class HybridLayer:
    kind: str                      # "mamba" | "attention" | "mlp"
    norm: torch.Tensor
    mamba: MambaWeights | None = None
    qkv: list | None = None        # attention: as LlamaModel._attention reads a layer
    o: object = None
    up: list | None = None         # mlp
    down: object = None
    qkv_bias = None
    q_norm = None
    k_norm = None

    def linears(self) -> list:
        m = self.mamba
        parts = [*(self.qkv or ()), self.o, *(self.up or ()), self.down]
        if m is not None:
            parts += [*m.in_proj, m.out_proj]
        return [p for p in parts if p is not None]

    def small_tensors(self) -> list:
        m = self.mamba
        rest = [] if m is None else [m.conv_weight, m.conv_bias, m.dt_bias, m.A_log, m.D, m.norm]
        return [t for t in (self.norm, *rest) if t is not None]


def _name(i: int, part: str) -> str:
    return f"backbone.layers.{i}.{part}"


def build_hybrid_weights(cfg: ModelConfig, src, *, device="cpu", dtype=torch.float32, progress=None) -> ModelWeights:
    """nemotron-h's tensors by their HF / mlx-lm names (backbone.layers.{i}.mixer.*), placed as build_weights places
    a llama's: linears in the source's storage, the rest dense. A_log, dt_bias and D stay fp32 (the scan's
    arithmetic; mlx-lm keeps A_log unrounded too)."""
    def need(name: str) -> str:
        if not src.has(name):
            raise CheckpointError(f"{src.path}: missing tensor {name!r} required by a {cfg.arch} model with "
                                  f"{cfg.num_layers} layers; the file is incomplete or not this architecture.")
        return name

    def dense(name: str, dt=dtype) -> torch.Tensor:
        return src.dense(need(name)).to(device=device, dtype=dt)

    def lin(names: list[str]) -> list:
        for n in names:
            need(n)
        return [gemv_width(_place(w, device, dtype)) for w in concat_linears(src.linears(names))]

    layers = []
    for i in range(cfg.num_layers):
        kind, mixer = cfg.layer_kind(i), _name(i, "mixer.")
        layer = HybridLayer(kind=kind, norm=dense(_name(i, "norm.weight")))
        if kind == "mamba":
            w = dense(mixer + "conv1d.weight")
            if w.numel() != cfg.conv_dim * cfg.conv_kernel:
                raise CheckpointError(f"{src.path}: {mixer}conv1d.weight has shape {tuple(w.shape)}, not "
                                      f"{cfg.conv_dim} channels of {cfg.conv_kernel} taps; the config does not match.")
            # HF stores (C, 1, K), mlx-lm (C, K, 1): both are the taps of each channel in order
            layer.mamba = MambaWeights(
                in_proj=lin([mixer + "in_proj.weight"]), conv_weight=w.reshape(cfg.conv_dim, cfg.conv_kernel),
                conv_bias=dense(mixer + "conv1d.bias") if cfg.conv_bias else None,
                dt_bias=dense(mixer + "dt_bias", torch.float32), A_log=dense(mixer + "A_log", torch.float32),
                D=dense(mixer + "D", torch.float32), norm=dense(mixer + "norm.weight"),
                out_proj=lin([mixer + "out_proj.weight"])[0])
        elif kind == "attention":
            layer.qkv = lin([mixer + f"{x}_proj.weight" for x in "qkv"])
            layer.o = lin([mixer + "o_proj.weight"])[0]
        else:
            layer.up = lin([mixer + "up_proj.weight"])
            layer.down = lin([mixer + "down_proj.weight"])[0]
        layers.append(layer)
        if progress is not None:
            progress(i + 1, cfg.num_layers)
    lm_head, embed = embedding_and_head(cfg, src, "backbone.embeddings.weight", lin, need, device, dtype)
    return ModelWeights(embed=embed, layers=layers, final_norm=dense("backbone.norm_f.weight"), lm_head=lm_head)


def random_hybrid_tensor(cfg: ModelConfig, name: str, randn) -> torch.Tensor | tuple:
    """A random stand-in for nemotron-h tensor `name` (RandomSource): its shape, and for the mixer's parameters
    values in their trained ranges (decays exp(-exp(A_log) * dt) in (0, 1), dt after softplus ~0.01-0.1)."""
    H, I, C, hidden = cfg.mamba_heads, cfg.mamba_inner, cfg.conv_dim, cfg.hidden_size
    q, kv = cfg.q_size, cfg.kv_size
    shapes = {"mixer.in_proj.weight": (I + C + H, hidden), "mixer.out_proj.weight": (hidden, I),
              "mixer.q_proj.weight": (q, hidden), "mixer.k_proj.weight": (kv, hidden),
              "mixer.v_proj.weight": (kv, hidden), "mixer.o_proj.weight": (hidden, q),
              "mixer.up_proj.weight": (cfg.intermediate_size, hidden),
              "mixer.down_proj.weight": (hidden, cfg.intermediate_size)}
    if name in ("backbone.embeddings.weight", "lm_head.weight"):
        return (cfg.vocab_size, hidden)
    rest = name.split(".", 3)[-1]
    if rest in shapes:
        return shapes[rest]
    if rest == "mixer.conv1d.weight":
        return randn((C, 1, cfg.conv_kernel), 0.5)
    if rest == "mixer.conv1d.bias":
        return randn((C,), 0.1)
    if rest == "mixer.A_log":
        return torch.log(torch.linspace(1.0, 16.0, H))
    if rest == "mixer.dt_bias":
        return torch.log(torch.expm1(torch.linspace(0.01, 0.1, H)))     # softplus^-1 of dt
    if rest == "mixer.D":
        return randn((H,), 0.1).add_(1.0)
    if rest == "mixer.norm.weight":
        return randn((I,), 0.05).add_(1.0)
    return randn((hidden,), 0.05).add_(1.0)                               # the layer norms and norm_f


class HybridModel(LlamaModel):
    """forward(input_ids (B, T), positions (B, T), cache: HybridCache) -> logits, as LlamaModel's."""

    # The engine's contract for a model whose rows carry recurrent state: every token a forward runs into a row
    # must be that row's next one (no padding past a prompt, no speculative tokens to take back).
    recurrent = True

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, ops=None):
        super().__init__(config, weights, ops=ops)
        # attention without rotation: rope at zero frequency is the identity (cos 1, sin 0), exactly
        self._inv_freq = torch.zeros(config.head_dim // 2, device=self.device)
        self._inv_freq_local = self._inv_freq

    def new_cache(self, batch: int, max_seq: int, *, dtype, device):
        from kilnx.runtime.kv_cache import HybridCache
        return HybridCache.for_hybrid(self.config, batch, max_seq, dtype=dtype, state_dtype=self.dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, *,
                last: int | torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        ops, cfg, w = self.ops, self.config, self.weights
        eps = cfg.rms_norm_eps
        rows_flat = self._rows_of(B, T, positions.device)
        flat_pos = positions.reshape(-1)
        emb = getattr(ops, "embedding", None)
        h = emb(w.embed, input_ids) if emb is not None else w.embed[input_ids.reshape(-1)]
        residual = None
        for i, layer in enumerate(w.layers):
            if residual is None:
                residual, x = h, ops.rms_norm(h, layer.norm, eps)
            else:
                residual, x = ops.add_rms_norm(h, residual, layer.norm, eps)
            if layer.kind == "mamba":
                h = self._mamba(i, layer.mamba, x, flat_pos, cache)
            elif layer.kind == "attention":
                h = self._attention(i, layer, x, positions, rows_flat, cache, B, T)
            else:
                h = _linear(ops, ops.relu2(_linear(ops, x, layer.up)), [layer.down])
        return self._logits_of(ops.add_rms_norm(h, residual, w.final_norm, eps)[1].view(B, T, -1), last)

    __call__ = forward

    def _mamba(self, i: int, m: MambaWeights, x, positions, cache):
        cfg, ops = self.config, self.ops
        n, I, C = x.shape[0], cfg.mamba_inner, cfg.conv_dim
        H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_groups, cfg.ssm_state_size
        proj = _linear(ops, x, m.in_proj)
        limit = cache.max_seq - 1            # the parking position (kernels/ssm.py)
        xbc = ops.conv1d_silu_(proj[:, I:I + C], m.conv_weight, m.conv_bias, cache.conv[i], positions, limit=limit)
        y = ops.ssm_scan_(xbc[:, :I].view(n, H, P), proj[:, I + C:], xbc[:, I:I + G * N].view(n, G, N),
                          xbc[:, I + G * N:].view(n, G, N), m.A_log, m.dt_bias, m.D, cache.ssm[i], positions,
                          limit=limit, dt_min=cfg.dt_limit[0], dt_max=cfg.dt_limit[1])
        y = ops.gated_rms_norm(y.view(n, I), proj[:, :I], m.norm, I // G, cfg.rms_norm_eps)
        return _linear(ops, y, [m.out_proj])

    def forward_mixed(self, *args, **kwargs):
        raise NotImplementedError("a hybrid model runs a prompt's chunk and a decode step as separate forwards "
                                  "(its rows' states advance token by token).")

