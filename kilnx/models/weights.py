"""Weight containers of a decoder, and how they are assembled from any checkpoint source.

A source (GGUF file, MLX or HF safetensors directory, random init) answers for tensors by their
HF name; `build_weights` asks for what the architecture needs and fuses q|k|v and gate|up into one
GEMM each whenever the parts share a storage format, because one larger GEMM reads the activations
once and launches once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Union

import torch

from kilnx.models.config import ModelConfig
from kilnx.models.errors import CheckpointError

Linear = Union[torch.Tensor, "QWeight"]  # noqa: F821 - kilnx.quant.QWeight, imported lazily


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: list                      # [fused (q+2kv, H)] or [q, k, v] when formats differ
    o: Linear
    mlp_norm: torch.Tensor         # the norm before the MLP
    gate_up: list                  # [fused (2F, H)] or [gate, up]; [] in an MoE layer
    down: Linear | None            # None in an MoE layer
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None   # gemma3 sandwich norms
    post_mlp_norm: torch.Tensor | None = None
    # an MoE layer's MLP: the router (E, H) and the expert stacks (E, 2F, H) [gate | up], (E, H, F)
    router: Linear | None = None
    experts_gate_up: "QWeight | None" = None  # noqa: F821
    experts_down: "QWeight | None" = None  # noqa: F821

    def linears(self) -> list:
        """Every 2-D linear (the expert stacks are counted apart, ModelWeights.nbytes)."""
        return [*self.qkv, self.o, *self.gate_up, *(t for t in (self.down, self.router) if t is not None)]

    def small_tensors(self) -> list:
        """Norms and biases."""
        return [t for t in (self.attn_norm, self.mlp_norm, self.qkv_bias, self.q_norm, self.k_norm,
                            self.post_attn_norm, self.post_mlp_norm) if t is not None]


@dataclass(frozen=True)
class QuantEmbedding:
    """The embedding table kept as the checkpoint's affine codes, where a dense copy would cost more memory
    than the codes (Gemma-3-270M: 671 MB of fp32 against 210 MB) and most of the load: a lookup dequantizes
    only the rows it reads (kernels/embedding.py). With tied embeddings this is the lm_head's own weight."""
    weight: object                 # QWeight (V, H): affine, 2/4/8-bit codes
    scale: float                   # config.embed_scale as `dtype` holds it, applied after rounding
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows' meaning (the torch peer's lookup): dequantized in fp32, rounded, times the scale."""
        from kilnx.kernels.embedding import dequantized_rows
        w = self.weight
        return dequantized_rows(w.packed, w.scales, w.biases, ids, w.bits, w.group_size, self.scale, self.dtype)


def quant_embedding_on() -> bool:
    """Whether embeddings stay quantized (on every device unless KILNX_QUANT_EMBED=0). On the H200 the
    lookup kernel left decode and first-token times as they were (llama-3.1-8b 535.3 / 535.5 tok/s against
    535.1 / 537.1 with the dense table, llama-3.2-1b 1750 / 1746 against 1746 / 1736, session 17) and
    llama-3.1-8b no longer holds a 1 GB bf16 copy of its embedding."""
    import os
    return os.environ.get("KILNX_QUANT_EMBED", "1") != "0"


def quant_embedding(w, scale: float, dtype: torch.dtype) -> QuantEmbedding | None:
    """A QuantEmbedding over `w` where the lookup kernel reads its format (affine, 2/4/8 bits, one matrix)
    and embeddings stay quantized on its device; else None (the table is made dense)."""
    QWeight = qweight_class()
    if (QWeight is None or not isinstance(w, QWeight) or not quant_embedding_on() or w.mode != "affine"
            or w.bits not in (2, 4, 8) or w.packed.dim() != 2):
        return None
    return QuantEmbedding(w, float(torch.tensor(scale, dtype=dtype)), dtype)


@dataclass
class ModelWeights:
    embed: "torch.Tensor | QuantEmbedding"   # (V, H) lookup table, pre-multiplied by config.embed_scale
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: list                  # [Linear (V, H)]
    rope_freq_factors: torch.Tensor | None = None   # llama.cpp's rope_freqs tensor, divides inv_freq
    extra: dict = field(default_factory=dict)

    def nbytes(self, expert_fraction: float = 1.0) -> int:
        """Bytes of weights a decode step reads (embedding lookup reads one row, so not counted); of the
        MoE expert stacks, `expert_fraction` (a one-token step reads top_k / E of them)."""
        total = 0
        seen = set()
        for w in _all_linears(self):
            if id(w) in seen:
                continue
            seen.add(id(w))
            total += linear_nbytes(w)
        for layer in self.layers:
            for w in (layer.experts_gate_up, layer.experts_down):
                if w is not None:
                    total += int(linear_nbytes(w) * expert_fraction)
        for t in _all_norms(self):
            total += t.numel() * t.element_size()
        return total


class WeightSource(Protocol):
    path: str

    def has(self, name: str) -> bool: ...
    def dense(self, name: str) -> torch.Tensor: ...
    def linears(self, names: list[str]) -> list: ...


def linear_nbytes(w) -> int:
    if hasattr(w, "nbytes") and not isinstance(w, torch.Tensor):
        return int(w.nbytes)
    return w.numel() * w.element_size()


def _all_linears(w: ModelWeights):
    """Every 2-D linear (the expert stacks are counted apart, see nbytes)."""
    for layer in w.layers:
        yield from layer.linears()
    yield from w.lm_head


def _all_norms(w: ModelWeights):
    for layer in w.layers:
        yield from layer.small_tensors()
    yield w.final_norm


def concat_linears(parts: list) -> list:
    """Fuse row-blocks of one GEMM into a single weight when they share a format, else keep the list.

    Dense tensors concatenate; QWeights concatenate their packed/scales/biases rows when mode, bits,
    group size and scale dtype agree (rows are independent in every format, so this is exact).
    """
    if len(parts) == 1:
        return parts
    if all(isinstance(p, torch.Tensor) for p in parts):
        if len({p.dtype for p in parts}) == 1:
            return [torch.cat(parts, 0)]
        return parts
    QWeight = qweight_class()
    if QWeight is not None and all(isinstance(p, QWeight) for p in parts):
        fmt = {(p.format, p.scales.dtype, p.global_scale is None, p.packed.dim(), p.packed.shape[:-2]) for p in parts}
        if len(fmt) == 1 and parts[0].global_scale is None:
            rows = parts[0].packed.dim() - 2       # the rows axis: 0, or 1 after an expert axis
            biases = None if parts[0].biases is None else torch.cat([p.biases for p in parts], rows)
            return [QWeight(torch.cat([p.packed for p in parts], rows), torch.cat([p.scales for p in parts], rows),
                            biases, format=parts[0].format,
                            dtype=None if parts[0].format.has_bias else parts[0].dtype)]
    return parts


def qweight_class():
    """kilnx.quant.QWeight, or None while the quant package is unavailable."""
    try:
        from kilnx.quant import QWeight
    except ImportError:
        try:
            from kilnx.quant.qweight import QWeight
        except ImportError:
            return None
    return QWeight


def _hf(i: int, part: str) -> str:
    return f"model.layers.{i}.{part}"


def build_weights(cfg: ModelConfig, src: WeightSource, *, device="cpu", dtype=torch.float32,
                  progress=None) -> ModelWeights:
    """Ask `src` for every tensor `cfg`'s architecture needs and place them on `device`; `progress(done, total)`
    after each layer (a GGUF MoE file's expert stacks take seconds a layer to convert).

    Norms, biases and the embedding table become dense `dtype`; linears stay in whatever storage
    the source gives (QWeight or dense) and are moved to `device`.
    """
    def need(name: str) -> str:
        if not src.has(name):
            stored = getattr(src, "gguf_name", lambda n: n)(name)     # the file's own name for it
            shown = repr(name) if stored == name else f"{stored!r} ({name})"
            raise CheckpointError(f"{src.path}: missing tensor {shown} required by a {cfg.arch} model with "
                                  f"{cfg.num_layers} layers; the file is incomplete or not this architecture.")
        return name

    def dense(name: str) -> torch.Tensor:
        return src.dense(need(name)).to(device=device, dtype=dtype)

    def lin(names: list[str]) -> list:
        for n in names:
            need(n)
        return [gemv_width(_place(w, device, dtype)) for w in concat_linears(src.linears(names))]

    if cfg.is_hybrid:
        from kilnx.models.hybrid_weights import build_hybrid_weights
        return build_hybrid_weights(cfg, src, device=device, dtype=dtype, progress=progress)
    gemma = cfg.arch == "gemma3"
    layers = []
    for i in range(cfg.num_layers):
        a = lambda p: _hf(i, p)  # noqa: E731
        qkv_names = [a(f"self_attn.{x}_proj.weight") for x in "qkv"]
        moe = cfg.layer_is_moe(i)
        layer = LayerWeights(
            attn_norm=dense(a("input_layernorm.weight")),
            qkv=lin(qkv_names),
            o=lin([a("self_attn.o_proj.weight")])[0],
            mlp_norm=dense(a("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
            gate_up=[] if moe else lin([a("mlp.gate_proj.weight"), a("mlp.up_proj.weight")]),
            down=None if moe else lin([a("mlp.down_proj.weight")])[0],
        )
        if moe:
            layer.router, layer.experts_gate_up, layer.experts_down = moe_weights(cfg, src, _hf(i, cfg.moe_block),
                                                                                  lin)
        if cfg.attention_bias:
            layer.qkv_bias = torch.cat([dense(a(f"self_attn.{x}_proj.bias")) for x in "qkv"])
        if cfg.qk_norm:
            layer.q_norm = dense(a("self_attn.q_norm.weight"))
            layer.k_norm = dense(a("self_attn.k_norm.weight"))
        if gemma:
            layer.post_attn_norm = dense(a("post_attention_layernorm.weight"))
            layer.post_mlp_norm = dense(a("post_feedforward_layernorm.weight"))
        layers.append(layer)
        if progress is not None:
            progress(i + 1, cfg.num_layers)

    lm_head, embed = embedding_and_head(cfg, src, "model.embed_tokens.weight", lin, need, device, dtype)
    freq = src.dense("rope_freqs") if src.has("rope_freqs") else None
    return ModelWeights(embed=embed, layers=layers,
                        final_norm=dense("model.norm.weight"), lm_head=lm_head, rope_freq_factors=freq)


def embedding_and_head(cfg: ModelConfig, src: WeightSource, embed_name: str, lin, need, device, dtype):
    """(lm_head, embedding table) of any decoder: the table kept quantized where it may (tied: the lm_head's own
    weight), else dense and pre-scaled by config.embed_scale."""
    tied = cfg.tie_embeddings or not src.has("lm_head.weight")
    lm_head = lin([embed_name if tied else "lm_head.weight"])
    # the embedding as the checkpoint stores it, where it may stay quantized: tied, the lm_head's own weight
    codes = None
    if tied:
        codes = lm_head[0] if len(lm_head) == 1 else None
    elif quant_embedding_on():
        codes = lin([embed_name])[0]
    embed = quant_embedding(codes, cfg.embed_scale, dtype)
    if embed is None:   # an unquantized checkpoint's table is the linear itself (the tied lm_head's too)
        embed = codes if isinstance(codes, torch.Tensor) else src.dense(need(embed_name))
        if cfg.embed_scale != 1.0:
            # gemma scales embeddings by sqrt(hidden) in the model dtype; baking it into the lookup table
            # costs nothing per token and leaves the tied lm_head unscaled.
            embed = embed.to(dtype) * torch.tensor(cfg.embed_scale, dtype=dtype)
        embed = embed.to(device=device, dtype=dtype)
    return lm_head, embed


def moe_weights(cfg: ModelConfig, src: WeightSource, block: str, lin, router: str = "gate.weight"):
    """(router, [gate | up] stack, down stack) of the MoE block `block` (e.g. model.layers.3.mlp), from mlx-lm's
    stacked `switch_mlp` tensors (qwen3-moe's under `mlp`, mixtral's and granite's under `block_sparse_moe`; granite's
    router is `router.layer.weight`)."""
    stack = block + ".switch_mlp.{}_proj.weight"
    hf_layout = [f"{block}.experts.0.{p}.weight" for p in ("gate_proj", "w1")] + [f"{block}.input_linear.weight"]
    if not src.has(stack.format("gate")) and any(src.has(n) for n in hf_layout):
        raise CheckpointError(f"{src.path}: the experts of this {cfg.arch} checkpoint are in HF's layout (one by one, "
                              f"or gate and up fused); kilnx runs MoE experts as quantized stacks: load it with "
                              f"--quantize q4, or convert it once with `kilnx convert <dir> <out>` and load that directory.")
    gate_up = lin([stack.format("gate"), stack.format("up")])
    down = lin([stack.format("down")])[0]
    QWeight = qweight_class()
    for w in (*gate_up, down):
        if QWeight is None or not isinstance(w, QWeight) or w.packed.dim() != 3:
            raise CheckpointError(f"{src.path}: {block}'s experts are not quantized (E, N, K) stacks; the MoE "
                                  f"kernels take MLX affine 2/4/8-bit experts (mlx_lm.convert -q).")
    if len(gate_up) != 1:
        raise CheckpointError(f"{src.path}: {block}'s gate and up experts differ in format; they must share "
                              f"bits and group size to run as one [gate | up] stack.")
    return lin([f"{block}.{router}"])[0], gate_up[0], down


def gemv_width(w):
    """An affine weight whose codes straddle words (3, 5, 6 bits: GGUF Q5_0/Q5_1/Q5_K, MLX 3/5/6-bit)
    widened to the next width the GEMVs and MoE kernels read (4 or 8 bits), exactly; others as they are.
    Why: those widths had no GEMV, so every decode step multiplied them with the tile GEMM: Gemma-3-270M's
    Q4_K_M file (Q5_0 where rows are not whole 256-blocks) decoded at 3-4 tok/s on 2 CPU cores, where
    SmolLM2-135M's 4-bit one ran at ~50. The cost is memory: 8/5 or 8/6 (4/3) of those weights' bytes."""
    QWeight = qweight_class()
    if QWeight is not None and isinstance(w, QWeight) and w.mode == "affine" and w.bits in (3, 5, 6):
        return w.widened(4 if w.bits == 3 else 8)
    return w


def _place(w, device, dtype):
    if isinstance(w, torch.Tensor):
        return w.to(device=device, dtype=dtype)
    return w.to(device)
