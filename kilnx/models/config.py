"""ModelConfig: the architecture numbers a model is built from, read from HF config.json or GGUF metadata.

One flat dataclass covers the llama family (llama 3.x, SmolLM2, mistral, qwen2, qwen3 with q/k norms),
gemma3, the MoE members qwen3-moe and mixtral (routed expert MLPs; which layers, how many experts), and the
hybrids nemotron-h and granite 4.0 h (Mamba-2 and attention layers in the order `layer_kinds` gives;
models/hybrid.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from kilnx.models.errors import UnsupportedArchitectureError

# Architectures the forward pass implements, keyed by our name. HF model_type and GGUF
# general.architecture spellings map onto these.
DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
MOE_ARCHS = ("qwen3_moe", "mixtral")
HYBRID_ARCHS = ("nemotron_h", "granitemoehybrid")
RUNNABLE_ARCHS = DENSE_ARCHS + MOE_ARCHS + HYBRID_ARCHS
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                   "gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
                   "nemotron_h": "nemotron_h", "granitemoehybrid": "granitemoehybrid"}
# nemotron-h's layer letters (hybrid_override_pattern) and the spellings of its layer-type lists
_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba", "linear_attention": "mamba",
                   "attention": "attention", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
               "qwen3moe": "qwen3_moe"}


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # {"type": "llama3"|"linear", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    # llama.cpp stores llama-arch q/k weights permuted for interleaved rotation (see loaders/gguf.py).
    rope_interleaved: bool = False
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False          # qwen2: biases on q, k, v
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"              # "silu" | "gelu_tanh"
    # gemma3 specifics
    norm_weight_offset: float = 0.0       # HF gemma stores w for (1 + w); llama.cpp stores 1 + w
    embed_scale: float = 1.0              # gemma multiplies embeddings by sqrt(hidden)
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()     # per layer "full" | "sliding"; empty = all full
    rope_local_theta: float | None = None # rope base of sliding layers
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # MoE (qwen3_moe, mixtral)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1          # every n-th layer is an MoE layer ...
    mlp_only_layers: tuple[int, ...] = () # ... except these, which keep a dense MLP
    router_scoring: str = "softmax"       # or "sigmoid" with a correction bias (nemotron-3, as DeepSeek-V3)
    routed_scaling_factor: float = 1.0    # the routed experts' weights times this (sigmoid routers)
    # hybrid (nemotron_h): per layer "mamba" | "attention" | "mlp" | "moe", and the Mamba-2 mixers' sizes
    layer_kinds: tuple[str, ...] = ()
    mamba_heads: int = 0                  # H: heads of P channels, each with a P x N state
    mamba_head_dim: int = 0               # P
    ssm_state_size: int = 0               # N
    ssm_groups: int = 0                   # G: B and C are shared by the H / G heads of a group
    conv_kernel: int = 4
    conv_bias: bool = True
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    ssm_norm_groups: int = 1              # the gated norm's groups (nemotron-h: G; granite: G as HF groups it)
    nope: bool = False                    # attention without positions (no rotary embedding)
    # granite's scalings: sublayer outputs times residual_multiplier before the residual add, logits divided by
    # logits_scaling; an MLP per layer after its mixer (the MoE's shared expert, or the dense MLP)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    shared_intermediate_size: int = 0
    name: str = ""

    # ---- derived ----
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def experts_gated(self) -> bool:
        """Whether each expert is a GLU over [gate | up] (qwen3-moe, mixtral, granite) or up alone (nemotron-3's relu²)."""
        return self.hidden_act != "relu2"

    @property
    def moe_block(self) -> str:
        """Where an MoE layer's router and experts live in HF / mlx-lm names."""
        return "block_sparse_moe" if self.arch in ("mixtral", "granitemoehybrid") else "mlp"

    def layer_is_moe(self, i: int) -> bool:
        return self.is_moe and i not in self.mlp_only_layers and (i + 1) % max(self.decoder_sparse_step, 1) == 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_kinds)

    @property
    def mamba_inner(self) -> int:
        """I = H * P: the mixer's channels (its gate z and its scanned x)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C (G * N each)."""
        return self.mamba_inner + 2 * self.ssm_groups * self.ssm_state_size

    def layer_kind(self, i: int) -> str:
        return self.layer_kinds[i] if self.layer_kinds else "attention"

    def layer_is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding" and self.sliding_window is not None

    def inv_freq(self, *, local: bool = False) -> torch.Tensor:
        """Per-pair rotary frequencies (head_dim/2,) fp32 with this config's scaling applied."""
        theta = self.rope_local_theta if (local and self.rope_local_theta) else self.rope_theta
        d = self.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        sc = self.rope_scaling if not local else None   # gemma3 scales only its global layers
        if sc:
            kind = sc.get("type") or sc.get("rope_type")
            if kind == "linear":
                inv = inv / float(sc["factor"])
            elif kind == "llama3":
                inv = _llama3_scale(inv, sc)
            elif kind not in (None, "default"):
                raise UnsupportedArchitectureError(
                    f"rope scaling {kind!r} is not implemented; supported: default, linear, llama3.")
        return inv.to(torch.float32)

    def check_supported(self, source: str = "") -> None:
        if self.arch not in RUNNABLE_ARCHS:
            where = f"{source}: " if source else ""
            extra = " (its MoE forward is not implemented yet)" if self.arch in MOE_ARCHS else ""
            raise UnsupportedArchitectureError(
                f"{where}architecture {self.arch!r} cannot be run{extra}; supported: {', '.join(RUNNABLE_ARCHS)}.")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


def _llama3_scale(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(sc["factor"])
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_mid, mid, out)


def _eos_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),)


def from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """From a transformers config.json dict (gemma3's multimodal wrapper: its text_config)."""
    if "text_config" in cfg and cfg.get("model_type") == "gemma3":
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    mt = cfg.get("model_type")
    arch = _HF_MODEL_TYPES.get(mt)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {mt!r} is not in the zoo; supported: {', '.join(sorted(_HF_MODEL_TYPES))}.")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    c = ModelConfig(
        arch=arch, name=cfg.get("_name_or_path", ""),
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0), num_layers=cfg.get("num_hidden_layers") or len(
            cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or ()),
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rope_theta=float(theta), rope_scaling=dict(scaling) if scaling else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", arch in ("gemma3",))),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
        num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or cfg.get("intermediate_size", 0)
                                  if arch in MOE_ARCHS else 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "mixtral")),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )
    if arch == "gemma3":
        c = _gemma3_from_hf(c, cfg)
    if arch == "nemotron_h":
        c = _nemotron_h_from_hf(c, cfg, source)
    if arch == "granitemoehybrid":
        c = _granite_hybrid_from_hf(c, cfg, source)
    return c


def _json_float(v) -> float:
    """A float as config.json spells it: a number, a string ("Infinity"), or transformers' {"__float__": "Infinity"}
    (JSON has no infinity)."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _nemotron_h_from_hf(c: ModelConfig, cfg: dict, source: str) -> ModelConfig:
    pattern = cfg.get("hybrid_override_pattern") or cfg.get("layers_block_type") or cfg.get("layer_types")
    if not pattern:
        raise UnsupportedArchitectureError(f"{source}: a nemotron_h config without hybrid_override_pattern or "
                                           "layers_block_type; the layer stack cannot be known.")
    unknown = sorted({str(p) for p in pattern} - _NEMOTRON_KINDS.keys())
    if unknown:
        raise UnsupportedArchitectureError(f"{source}: nemotron_h layer types {unknown} are not known; expected "
                                           "M, *, -, E (mamba, attention, mlp, moe).")
    kinds = tuple(_NEMOTRON_KINDS[p] for p in pattern)
    moe = _nemotron_moe(cfg, source) if "moe" in kinds else dict(num_experts=0, num_experts_per_tok=0,
                                                                  moe_intermediate_size=0)
    biased = [k for k in ("attention_bias", "mlp_bias", "mamba_proj_bias", "use_bias") if cfg.get(k)]
    if biased:
        raise UnsupportedArchitectureError(f"{source}: nemotron_h with {', '.join(biased)} set; kilnx runs the "
                                           "released configs, whose linear layers have no biases.")
    heads = c.num_heads
    head_dim = cfg.get("head_dim") or cfg.get("attention_head_dim") or c.hidden_size // heads
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return c.with_(layer_kinds=kinds, num_layers=len(kinds), head_dim=int(head_dim), hidden_act="relu2",
                   rms_norm_eps=float(cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-5))),
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=False, attention_bias=False,
                   mamba_heads=int(cfg["mamba_num_heads"]), mamba_head_dim=int(cfg["mamba_head_dim"]),
                   ssm_state_size=int(cfg["ssm_state_size"]), ssm_groups=int(cfg.get("n_groups", 1)),
                   conv_kernel=int(cfg.get("conv_kernel", 4)), conv_bias=bool(cfg.get("use_conv_bias", True)),
                   dt_limit=(_json_float(limit[0]), _json_float(limit[1])), ssm_norm_groups=int(cfg.get("n_groups", 1)),
                   nope=True, **moe)


def _nemotron_moe(cfg: dict, source: str) -> dict:
    """nemotron-3's MoE layers (E): ungated relu² experts chosen by a sigmoid router with a correction bias
    (DeepSeek-V3's routing, one expert group), beside one shared relu² expert."""
    sizes = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size")
    missing = [k for k in sizes if not cfg.get(k)]
    if missing:
        raise UnsupportedArchitectureError(f"{source}: nemotron_h MoE layers (E) without {', '.join(missing)} in "
                                           "its config; the experts' sizes cannot be known.")
    if int(cfg.get("n_group") or 1) != 1 or int(cfg.get("topk_group") or 1) != 1:
        raise UnsupportedArchitectureError(f"{source}: nemotron_h MoE with n_group {cfg.get('n_group')} / topk_group "
                                           f"{cfg.get('topk_group')}; kilnx routes over one expert group (the "
                                           "released Nemotron-3 configs: 1 / 1).")
    if cfg.get("moe_latent_size"):
        raise UnsupportedArchitectureError(f"{source}: nemotron_h MoE with a latent projection (moe_latent_size "
                                           f"{cfg['moe_latent_size']}) is not supported yet; kilnx runs experts on "
                                           "the hidden size (Nemotron-3 Nano).")
    if int(cfg.get("n_shared_experts") or 0) != 1:
        raise UnsupportedArchitectureError(f"{source}: nemotron_h MoE with n_shared_experts "
                                           f"{cfg.get('n_shared_experts')}; kilnx runs one shared expert beside the "
                                           "routed ones (the released configs).")
    return dict(num_experts=int(cfg["n_routed_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                shared_intermediate_size=int(cfg["moe_shared_expert_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router_scoring="sigmoid",
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


def _granite_hybrid_from_hf(c: ModelConfig, cfg: dict, source: str) -> ModelConfig:
    """IBM's Granite 4.0 H: each layer a Mamba-2 or attention mixer, then an MLP (dense, or routed experts beside a
    shared one), with granite's multipliers. The gated norm is grouped as HF groups it (mlx-lm normalizes the whole
    row; the released configs have one group, where both agree). Without time_step_limit, HF's (0, inf)."""
    types = cfg.get("layer_types") or ["mamba"] * c.num_layers
    unknown = sorted({str(t) for t in types} - _NEMOTRON_KINDS.keys())
    if unknown:
        raise UnsupportedArchitectureError(f"{source}: granitemoehybrid layer types {unknown} are not known; expected "
                                           "mamba and attention.")
    kinds = tuple(_NEMOTRON_KINDS[t] for t in types)
    biased = [k for k in ("attention_bias", "mlp_bias", "mamba_proj_bias") if cfg.get(k)]
    if biased:
        raise UnsupportedArchitectureError(f"{source}: granitemoehybrid with {', '.join(biased)} set; kilnx runs the "
                                           "released configs, whose linear layers have no biases.")
    experts = int(cfg.get("num_local_experts") or 0)
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    heads = int(cfg["mamba_n_heads"])
    groups = int(cfg.get("mamba_n_groups", 1))
    return c.with_(layer_kinds=kinds, num_layers=len(kinds), hidden_act="silu", qk_norm=False,
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                   mamba_heads=heads, mamba_head_dim=int(cfg.get("mamba_d_head") or 0),
                   ssm_state_size=int(cfg.get("mamba_d_state", 128)), ssm_groups=groups,
                   conv_kernel=int(cfg.get("mamba_d_conv", 4)), conv_bias=bool(cfg.get("mamba_conv_bias", True)),
                   dt_limit=(_json_float(limit[0]), _json_float(limit[1])), ssm_norm_groups=groups,
                   nope=cfg.get("position_embedding_type") == "nope",
                   embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                   query_pre_attn_scalar=float(cfg.get("attention_multiplier", c.head_dim ** -0.5)) ** -2,
                   residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                   logits_scaling=float(cfg.get("logits_scaling", 1.0)),
                   shared_intermediate_size=int(cfg.get("shared_intermediate_size") or 0) if experts else
                   int(cfg.get("shared_intermediate_size") or cfg.get("intermediate_size") or 0),
                   num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate_size=int(cfg.get("intermediate_size") or 0) if experts else 0,
                   # the router's softmax over the chosen logits: the top-k of the full softmax, renormalized
                   norm_topk_prob=True)


def _gemma3_from_hf(c: ModelConfig, cfg: dict) -> ModelConfig:
    n = c.num_layers
    types = cfg.get("layer_types")
    if types:
        types = tuple("sliding" if t.startswith("sliding") else "full" for t in types)
    else:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    rope = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq") or (rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)
    full = rope.get("full_attention") or {}
    theta = cfg.get("rope_theta") or full.get("rope_theta", 1_000_000.0)
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type") not in (None, "default") else None)
    return c.with_(hidden_act="gelu_tanh", norm_weight_offset=1.0, embed_scale=math.sqrt(c.hidden_size),
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", c.head_dim)),
                   sliding_window=cfg.get("sliding_window"), layer_types=types,
                   rope_theta=float(theta), rope_local_theta=float(local_theta),
                   rope_scaling=dict(scaling) if scaling else None,
                   attn_logit_softcap=cfg.get("attn_logit_softcapping"),
                   final_logit_softcap=cfg.get("final_logit_softcapping"))


def from_gguf_metadata(meta: dict, source: str = "model.gguf", *, vocab_size: int | None = None) -> ModelConfig:
    """From GGUF key/values (plain python values). `vocab_size` falls back to the token list length."""
    ga = meta.get("general.architecture")
    arch = _GGUF_ARCHS.get(ga)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{source}: GGUF architecture {ga!r} is not in the zoo; supported: {', '.join(sorted(_GGUF_ARCHS))}.")
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0):
        arch = "mixtral"    # llama.cpp writes mixtral as llama with experts

    def k(key, default=None):
        return meta.get(f"{ga}.{key}", default)

    heads = int(k("attention.head_count"))
    kv = k("attention.head_count_kv", heads)
    kv = int(kv[0] if isinstance(kv, (list, tuple)) else kv)
    hidden = int(k("embedding_length"))
    head_dim = int(k("attention.key_length", 0) or hidden // heads)
    ffn = k("feed_forward_length", 0)
    ffn = int(ffn[0] if isinstance(ffn, (list, tuple)) else ffn)
    vocab = int(k("vocab_size", 0) or vocab_size or len(meta.get("tokenizer.ggml.tokens", ())))
    scaling = None
    stype = k("rope.scaling.type")
    if stype == "linear":
        scaling = {"type": "linear", "factor": float(k("rope.scaling.factor", 1.0))}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    c = ModelConfig(
        arch=arch, name=str(meta.get("general.name", "")), vocab_size=vocab, hidden_size=hidden,
        intermediate_size=ffn, num_layers=int(k("block_count")), num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, rope_theta=float(k("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rope_interleaved=(ga == "llama"), rms_norm_eps=float(k("attention.layer_norm_rms_epsilon", 1e-5)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"), attention_bias=(arch == "qwen2"),
        max_position_embeddings=int(k("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=tuple(eos_ids),
        num_experts=int(k("expert_count", 0) or 0), num_experts_per_tok=int(k("expert_used_count", 0) or 0),
        moe_intermediate_size=int(k("expert_feed_forward_length", 0) or (ffn if arch == "mixtral" else 0)),
        # llama.cpp renormalizes the top-k weights of both (qwen3-moe's released configs: norm_topk_prob true;
        # mixtral's softmax over the chosen experts is the same thing)
        norm_topk_prob=arch in MOE_ARCHS,
    )
    if arch == "gemma3":
        window = k("attention.sliding_window")
        pattern = 6
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(c.num_layers))
        c = c.with_(hidden_act="gelu_tanh", norm_weight_offset=0.0, embed_scale=math.sqrt(hidden),
                    query_pre_attn_scalar=float(head_dim), sliding_window=int(window) if window else None,
                    layer_types=types, rope_local_theta=10000.0, tie_embeddings=True)
    return c


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (its bf16 GEMMs are slow and it is the reference path), bf16 on GPUs."""
    return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
