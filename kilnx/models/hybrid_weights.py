"""The weights of the hybrid decoders (models/hybrid.py), read by their HF / mlx-lm names.

nemotron-h: `backbone.layers.{i}.norm` then `.mixer.*` (a Mamba-2 mixer, attention, an up / relu² / down MLP, or
nemotron-3's MoE: `gate.weight` and `gate.e_score_correction_bias`, mlx-lm's expert stacks `switch_mlp.fc1` (up) and
`switch_mlp.fc2` (down), and `shared_experts.{up,down}_proj`).
granite 4.0 h (granitemoehybrid): `model.layers.{i}.input_layernorm` then `.mamba.*` or `.self_attn.*`, then
`.post_attention_layernorm` and an MLP: dense (mlx-lm's `mlp.{gate,up,down}_proj`, or HF's `shared_mlp.input_linear`
[gate | up] and `output_linear`), or routed experts (`block_sparse_moe.router.layer`, mlx-lm's `switch_mlp` stacks)
beside the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kilnx.models.config import ModelConfig
from kilnx.models.errors import CheckpointError
from kilnx.models.weights import ModelWeights, _place, concat_linears, embedding_and_head, gemv_width, moe_weights


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
class FeedForward:
    """granite's MLP after each mixer: SwiGLU over [gate | up] (the dense MLP, or the MoE's shared expert), and in an
    MoE layer the routed experts beside it."""
    norm: torch.Tensor
    gate_up: list
    down: object
    router: object = None
    experts_gate_up: object = None
    experts_down: object = None


@dataclass
class RoutedExperts:
    """nemotron-3's MoE layer: ungated relu² experts (up (E, F, H), down (E, H, F)) chosen by a sigmoid router whose
    correction bias steers the choice, beside one shared relu² expert."""
    router: torch.Tensor           # (E, hidden), dense fp32
    router_bias: torch.Tensor      # (E,) fp32
    up: object                     # QWeight (E, F, hidden)
    down: object                   # QWeight (E, hidden, F)
    shared_up: list
    shared_down: object


@dataclass
class HybridLayer:
    kind: str                      # "mamba" | "attention" | "mlp" | "moe"
    norm: torch.Tensor
    mamba: MambaWeights | None = None
    qkv: list | None = None        # attention: as LlamaModel._attention reads a layer
    o: object = None
    up: list | None = None         # nemotron-h's MLP layer: up, relu², down
    down: object = None
    ffn: FeedForward | None = None # granite: the MLP after the mixer
    moe: RoutedExperts | None = None  # nemotron-3's MoE layer
    qkv_bias = None
    q_norm = None
    k_norm = None

    @property
    def experts_gate_up(self):
        """The layer's expert stack read before the activation ([gate | up], or nemotron-3's up)."""
        return self.moe.up if self.moe is not None else self.ffn.experts_gate_up if self.ffn is not None else None

    @property
    def experts_down(self):
        return self.moe.down if self.moe is not None else self.ffn.experts_down if self.ffn is not None else None

    def linears(self) -> list:
        """Every 2-D linear (an MoE's expert stacks are counted apart, ModelWeights.nbytes)."""
        m, f, e = self.mamba, self.ffn, self.moe
        parts = [*(self.qkv or ()), self.o, *(self.up or ()), self.down]
        if m is not None:
            parts += [*m.in_proj, m.out_proj]
        if f is not None:
            parts += [*f.gate_up, f.down, f.router]
        if e is not None:
            parts += [e.router, *e.shared_up, e.shared_down]
        return [p for p in parts if p is not None]

    def small_tensors(self) -> list:
        """Norms and the mixer's small parameters."""
        m = self.mamba
        rest = [] if m is None else [m.conv_weight, m.conv_bias, m.dt_bias, m.A_log, m.D, m.norm]
        if self.moe is not None:
            rest.append(self.moe.router_bias)
        return [t for t in (self.norm, *rest, self.ffn.norm if self.ffn else None) if t is not None]


# per architecture: (layer prefix, the mixer's norm, Mamba-2 prefix, attention prefix, embedding, final norm)
_NAMES = {"nemotron_h": ("backbone.layers.{}.", "norm.weight", "mixer.", "mixer.", "backbone.embeddings.weight",
                         "backbone.norm_f.weight"),
          "granitemoehybrid": ("model.layers.{}.", "input_layernorm.weight", "mamba.", "self_attn.",
                               "model.embed_tokens.weight", "model.norm.weight")}


def build_hybrid_weights(cfg: ModelConfig, src, *, device="cpu", dtype=torch.float32, progress=None) -> ModelWeights:
    """A hybrid model's tensors placed as build_weights places a llama's: linears in the source's storage, the rest
    dense. A_log, dt_bias and D stay fp32 (the scan's arithmetic; mlx-lm keeps A_log unrounded too). granite's
    logits_scaling is folded into the final norm's weight (logits / s = lm_head(norm(h) * (w / s)))."""
    layer_at, norm_name, mamba_at, attn_at, embed_name, final_name = _NAMES[cfg.arch]

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
        kind, at = cfg.layer_kind(i), layer_at.format(i)
        layer = HybridLayer(kind=kind, norm=dense(at + norm_name))
        if kind == "mamba":
            layer.mamba = _mamba(cfg, src, at + mamba_at, dense, lin)
        elif kind == "attention":
            layer.qkv = lin([at + attn_at + f"{x}_proj.weight" for x in "qkv"])
            layer.o = lin([at + attn_at + "o_proj.weight"])[0]
        elif kind == "moe":
            layer.moe = _nemotron_moe(cfg, src, at + "mixer.", dense, lin)
        else:
            layer.up = lin([at + "mixer.up_proj.weight"])
            layer.down = lin([at + "mixer.down_proj.weight"])[0]
        if cfg.arch == "granitemoehybrid":
            layer.ffn = _granite_ffn(cfg, src, at, dense, lin)
        layers.append(layer)
        if progress is not None:
            progress(i + 1, cfg.num_layers)
    lm_head, embed = embedding_and_head(cfg, src, embed_name, lin, need, device, dtype)
    final = (src.dense(need(final_name)).float() / cfg.logits_scaling).to(device=device, dtype=dtype)
    return ModelWeights(embed=embed, layers=layers, final_norm=final, lm_head=lm_head)


def _mamba(cfg: ModelConfig, src, at: str, dense, lin) -> MambaWeights:
    w = dense(at + "conv1d.weight")
    if w.numel() != cfg.conv_dim * cfg.conv_kernel:
        raise CheckpointError(f"{src.path}: {at}conv1d.weight has shape {tuple(w.shape)}, not {cfg.conv_dim} "
                              f"channels of {cfg.conv_kernel} taps; the config does not match.")
    # HF stores (C, 1, K), mlx-lm (C, K, 1): both are the taps of each channel in order
    return MambaWeights(in_proj=lin([at + "in_proj.weight"]), conv_weight=w.reshape(cfg.conv_dim, cfg.conv_kernel),
                        conv_bias=dense(at + "conv1d.bias") if cfg.conv_bias else None,
                        dt_bias=dense(at + "dt_bias", torch.float32), A_log=dense(at + "A_log", torch.float32),
                        D=dense(at + "D", torch.float32), norm=dense(at + "norm.weight"),
                        out_proj=lin([at + "out_proj.weight"])[0])


def _nemotron_moe(cfg: ModelConfig, src, at: str, dense, lin) -> RoutedExperts:
    up, down = (at + "switch_mlp.fc1.weight", at + "switch_mlp.fc2.weight")
    if not src.has(up) and src.has(at + "experts.0.up_proj.weight"):
        raise CheckpointError(f"{src.path}: the experts of this nemotron_h checkpoint are in HF's layout; kilnx runs "
                              "MoE experts as quantized stacks: load it with --quantize q4, or convert it once with "
                              "`kilnx convert <dir> <out>` and load that directory.")
    experts = lin([up]) + lin([down])
    from kilnx.quant import QWeight
    for w in experts:
        if not isinstance(w, QWeight) or w.packed.dim() != 3:
            raise CheckpointError(f"{src.path}: {at}switch_mlp's experts are not quantized (E, N, K) stacks; the MoE "
                                  f"kernels take MLX affine 2/4/8-bit experts (mlx_lm.convert -q).")
    # the router stays dense and fp32, as HF keeps it (mlx-lm's is not a Linear, so never quantized): bf16 logits
    # would decide near-ties between experts on 8 bits
    return RoutedExperts(router=dense(at + "gate.weight", torch.float32), router_bias=dense(at + "gate.e_score_correction_bias", torch.float32),
                         up=experts[0], down=experts[1], shared_up=lin([at + "shared_experts.up_proj.weight"]),
                         shared_down=lin([at + "shared_experts.down_proj.weight"])[0])


def _granite_ffn(cfg: ModelConfig, src, at: str, dense, lin) -> FeedForward:
    norm = dense(at + "post_attention_layernorm.weight")
    if src.has(at + "mlp.gate_proj.weight"):          # mlx-lm's dense layout
        f = FeedForward(norm, lin([at + "mlp.gate_proj.weight", at + "mlp.up_proj.weight"]),
                        lin([at + "mlp.down_proj.weight"])[0])
    else:                                             # HF's, and every MoE layer's shared expert: [gate | up] fused
        f = FeedForward(norm, lin([at + "shared_mlp.input_linear.weight"]), lin([at + "shared_mlp.output_linear.weight"])[0])
    if cfg.is_moe:
        f.router, f.experts_gate_up, f.experts_down = moe_weights(cfg, src, at + cfg.moe_block, lin,
                                                                  router="router.layer.weight")
    return f


def random_hybrid_tensor(cfg: ModelConfig, name: str, randn) -> torch.Tensor | tuple:
    """A random stand-in for a hybrid model's tensor `name` (RandomSource): its shape, and for the mixer's parameters
    values in their trained ranges (decays exp(-exp(A_log) * dt) in (0, 1), dt after softplus ~0.01-0.1)."""
    H, I, C, hidden = cfg.mamba_heads, cfg.mamba_inner, cfg.conv_dim, cfg.hidden_size
    q, kv, F, S = cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.shared_intermediate_size
    E, Fe = cfg.num_experts, cfg.moe_intermediate_size
    shapes = {"in_proj.weight": (I + C + H, hidden), "out_proj.weight": (hidden, I), "q_proj.weight": (q, hidden),
              "k_proj.weight": (kv, hidden), "v_proj.weight": (kv, hidden), "o_proj.weight": (hidden, q),
              "mixer.up_proj.weight": (F, hidden), "mixer.down_proj.weight": (hidden, F),
              "mlp.gate_proj.weight": (S, hidden), "mlp.up_proj.weight": (S, hidden), "mlp.down_proj.weight": (hidden, S),
              "shared_mlp.input_linear.weight": (2 * S, hidden), "shared_mlp.output_linear.weight": (hidden, S),
              "router.layer.weight": (E, hidden), "switch_mlp.gate_proj.weight": (E, Fe, hidden),
              "switch_mlp.up_proj.weight": (E, Fe, hidden), "switch_mlp.down_proj.weight": (E, hidden, Fe),
              "switch_mlp.fc1.weight": (E, Fe, hidden), "switch_mlp.fc2.weight": (E, hidden, Fe),
              "shared_experts.up_proj.weight": (S, hidden), "shared_experts.down_proj.weight": (hidden, S)}
    if name.endswith("embeddings.weight") or name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return (cfg.vocab_size, hidden)
    for suffix, shape in shapes.items():
        if name.endswith("." + suffix):
            return shape
    last = name.rsplit(".", 1)[-1]
    if name.endswith("mixer.gate.weight"):           # nemotron-3's router, read dense
        return randn((E, hidden), hidden ** -0.5)
    if last == "e_score_correction_bias":
        return randn((E,), 0.01)
    if name.endswith("conv1d.weight"):
        return randn((C, 1, cfg.conv_kernel), 0.5)
    if name.endswith("conv1d.bias"):
        return randn((C,), 0.1)
    if last == "A_log":
        return torch.log(torch.linspace(1.0, 16.0, H))
    if last == "dt_bias":
        return torch.log(torch.expm1(torch.linspace(0.01, 0.1, H)))     # softplus^-1 of dt
    if last == "D":
        return randn((H,), 0.1).add_(1.0)
    if name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
        return randn((I,), 0.05).add_(1.0)
    return randn((hidden,), 0.05).add_(1.0)                               # the layer norms and the final one
