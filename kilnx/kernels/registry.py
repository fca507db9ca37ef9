"""Every kernel in the library, by name, and the tuning problems a model needs.

The tuner and `kilnx kernels list` find kernels here; a kernel object follows the protocol in
kilnx/dsl/kernel.py.
"""

from __future__ import annotations

import importlib

MODULES = ("norms", "activations", "rope", "attention", "attention_split", "attention_decode", "prepared", "qmatmul",
           "qmv_h2", "qkv_rope", "qk_norm_rope", "qmv_tc", "qmatmul_path", "qmatmul_fp4", "fp4_qmv_h2", "routing",
           "moe_align", "moe", "moe_combine", "moe_h2", "moe_onepass", "moe_decode_route", "moe_route", "qmv_cpu",
           "embedding", "qmv_wg", "wg_direct", "ssm", "swiglu_prep")


# Kernels tuned in a model's decode step (tuner/step_paths.py), never call by call, and only when named
# (`kilnx tune --model M --kernel qmatmul_path`). qmatmul_path: on the H100 two paths that won their one-call trials by
# 7% and 3.5% (o at 4 rows, down at 2) decoded llama-3.1-8b at 0.98x / 0.95x the untuned rate at 4 / 2 rows
# (bench/results/2026-12-06_h100_batch_decode_paths_tuned_s33.csv); the step trial captures the model's step for each
# candidate, minutes for an 8B model, so a tune runs it where asked.
STEP_TUNED = frozenset({"qmatmul_path"})


def all() -> list:  # noqa: A001 - the registry's natural verb
    found = {}
    for mod in MODULES:
        try:
            m = importlib.import_module(f"kilnx.kernels.{mod}")
        except ImportError:
            continue
        for obj in vars(m).values():
            if hasattr(obj, "space") and hasattr(obj, "source_hash") and hasattr(obj, "compile"):
                found[obj.name] = obj
    return sorted(found.values(), key=lambda k: k.name)


def get(name: str):
    for k in all():
        if k.name == name:
            return k
    names = ", ".join(k.name for k in all())
    raise KeyError(f"no kernel named {name!r}; registered kernels: {names}")


def source_hashes() -> dict[str, str]:
    return {k.name: k.source_hash for k in all()}


def problems_for_model(model: str, gpu: bool = True) -> list[tuple[str, dict]]:
    """(kernel name, problem) pairs for a zoo preset or a model path: decode and prefill shapes of
    its norms, activations and quantized GEMMs, and for an MoE model its align step, grouped GEMMs and
    per-slot GEMVs. GEMVs: 4-bit, in 32-element groups for the small presets (their bundled checkpoints,
    SmolLM2 Q4_1 and Gemma-3 Q4_K, load as gs32) and gs64 otherwise (the runtime's --random format);
    `gpu` picks the kernel the runtime calls there (qmv_h2 on the GPU, the interleaved qmv_il on the CPU)."""
    from kilnx.models.presets import get_preset, problems
    cfg = get_preset(model)
    from kilnx.models.loaders import BUNDLED
    gs = 32 if model in BUNDLED else 64
    gemv = "qmv_h2" if gpu else "qmv_il"   # the GPU's 4-bit rows go to qmv_h2, the CPU's to qmv_il
    width = cfg.intermediate_size or cfg.moe_intermediate_size
    fused_qkv = gpu and cfg.head_dim % 64 == 0 and not cfg.qk_norm and not cfg.attention_bias

    from kilnx.kernels.qmatmul_path import ROWS as PATH_ROWS
    from kilnx.kernels.routing import WG_MIN_ROWS
    from kilnx.kernels.wg_direct import takes_shape

    def wgmma(g: dict) -> bool:
        """Whether the GPU's route sends this shape's 4-16 row calls to qmm_wg_direct (kernels/wg_direct.py)."""
        return gpu and takes_shape(g["N"], g["K"], gs)

    def decode(m: int) -> list[tuple[str, dict]]:
        out = [("qmm_wg_direct", {"M": m, "N": g["N"], "K": g["K"]}) if m >= WG_MIN_ROWS and wgmma(g)
               else (gemv, {"M": m, "N": g["N"], "K": g["K"], "bits": 4, "gs": gs}) for g in problems(cfg)]
        if fused_qkv:   # the decode qkv projection with its rope + cache epilogue (kernels/qkv_rope.py)
            out.append(("qkv_rope_cache_h2", {"M": m, "Hq": cfg.num_heads, "Hk": cfg.num_kv_heads,
                                              "D": cfg.head_dim, "K": cfg.hidden_size, "bits": 4, "gs": gs}))
        if cfg.qk_norm:   # per-head q/k norms, rope and the cache write (kernels/qk_norm_rope.py)
            out.append(("qk_norm_rope_cache_kernel", {"T": m, "Hq": cfg.num_heads, "Hk": cfg.num_kv_heads,
                                                      "D": cfg.head_dim, "R": cfg.head_dim, "dtype": "bf16"}))
        return out

    def rows(n: int) -> list[tuple[str, dict]]:
        act = ("relu2_kernel", {"rows": n, "D": width, "dtype": "bf16"}) if cfg.hidden_act == "relu2" else \
            ("silu_mul_kernel", {"rows": n, "D": width, "dtype": "bf16"})
        return [("add_rms_norm_kernel", {"rows": n, "D": cfg.hidden_size, "dtype": "bf16"}),
                ("rms_norm_kernel", {"rows": n, "D": cfg.hidden_size, "dtype": "bf16"}), act]

    def mixer(T: int, nseq: int = 1) -> list[tuple[str, dict]]:
        """A hybrid model's Mamba-2 conv and scan at its own sizes (kernels/ssm.py)."""
        if not cfg.is_hybrid:
            return []
        p = {"H": cfg.mamba_heads, "P": cfg.mamba_head_dim, "G": cfg.ssm_groups, "N": cfg.ssm_state_size,
             "K": cfg.conv_kernel, "T": T, "nseq": nseq}
        from kilnx.kernels.ssm import chunked_scan_from
        scan = "ssm_chunk_scan_kernel" if T >= chunked_scan_from() else "ssm_scan_kernel"   # the form the route runs
        return [(scan, p), ("conv1d_silu_kernel", p)]

    def split_attention() -> list[tuple[str, dict]]:
        """The GPU's one-row decode attention, split over key ranges (kernels/attention_split.py), at the caches of
        a 128- and a 2048-token prompt (tuned with its merge; a config serves its own cache length class)."""
        if not gpu:
            return []
        return [("attention_split_kernel", {"B": 1, "T": 1, "Hq": cfg.num_heads, "Hk": cfg.num_kv_heads,
                                            "D": cfg.head_dim, "S": S, "ctx": S, "dtype": "bf16"}) for S in (256, 2048)]

    # Most important first: a tune whose budget runs out skips the tail (tuner/session.py). One-token
    # decode is what a user waits on token after token; then 4-row decode, MoE, and prefill.
    out = decode(1) + rows(1) + split_attention() + mixer(1) + (decode(4) + mixer(1, 4) if gpu else [])
    out += [("qmm_wg_direct", {"M": 16, "N": g["N"], "K": g["K"]}) for g in problems(cfg) if wgmma(g)]
    if cfg.is_moe:
        from kilnx.kernels.moe_specs import moe_problems
        # prefill from 128 tokens: their grouped GEMMs run 16-row blocks (a few tokens an expert), a bucket 512 tokens'
        # 32-row blocks do not stand for (nemotron-3's 128-token prefill: 0.75 ms a layer in them, H100, session 30)
        out += moe_problems(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                            prefill=(128, 512, 2048), gpu=gpu, gated=cfg.experts_gated)
        if cfg.router_scoring == "sigmoid":   # nemotron-3's router stays dense fp32: a GEMV of its own at decode
            out += [("dense_gemv", {"M": m, "N": cfg.num_experts, "K": cfg.hidden_size, "dtype": "f32"})
                    for m in ((1, 4) if gpu else ())]
    for g in problems(cfg):
        # the GPU multiplies from 320 rows (and above 128 where the fused kernel's grid is starved) by
        # dequantizing once and running the dense `mm` (kernels/routing.py): prompts there tune `mm`
        fused_rows, dense_rows = ((16, 128), (512, 2048)) if gpu else ((16, 512, 2048), ())
        out += [("qmm", {"M": m, "N": g["N"], "K": g["K"], "bits": 4, "gs": 64}) for m in fused_rows]
        out += [("mm", {"M": m, "N": g["N"], "K": g["K"]}) for m in dense_rows]
        if gpu and not g["name"].startswith("expert_"):   # one choice per row count a decode graph runs
            # (kernels/qmatmul_path.py; tuned in the model's decode step, STEP_TUNED)
            out += [("qmatmul_path", {"N": g["N"], "K": g["K"], "bits": 4, "gs": 64, "M": m}) for m in PATH_ROWS]
        else:
            out.append(("qmatmul_rows_crossover", {"N": g["N"], "K": g["K"], "bits": 4, "gs": 64}))
    out += rows(2048) + mixer(2048)
    return out
