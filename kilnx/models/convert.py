"""Quantizing dense checkpoints: `kilnx convert` (an MLX-format directory written once, as `mlx_lm.convert -q`
writes it; from a GGUF file too, models/gguf_convert.py) and `--quantize` (the same quantization at load,
nothing written).

What is quantized is what mlx-lm quantizes by default: every 2-D `.weight` of a linear layer or an embedding
whose last dimension divides into groups; norms, biases and anything else stay as they are. The codes are
bit-exact with `mx.quantize` (kilnx.quant), so mlx-lm loads a converted directory and computes the same
model. Weights that are already quantized (an MLX directory) are copied as they are; where their format
differs from the one asked for, config.json names it per module, as mlx-lm's mixed-precision files do.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from kilnx.models.errors import CheckpointError, ModelError

SHARD_BYTES = 4 << 30          # mlx-lm shards at 5 GB; a shard of this size is written and freed before the next
FORMATS = {"q4": ("affine", 4, 64), "q8": ("affine", 8, 64), "mxfp4": ("mxfp4", None, None),
           "nvfp4": ("nvfp4", None, None)}


def quant_format(name: str, bits: int | None = None, group_size: int | None = None):
    """A QuantFormat from a short name (q4, q8, mxfp4, nvfp4) or a mode (affine ...), bits and group size
    overriding the name's."""
    from kilnx.quant.qweight import QuantFormat
    mode, b, g = FORMATS.get(name, (name, None, None))
    try:
        return QuantFormat.resolve(mode, bits if bits is not None else b, group_size if group_size is not None else g)
    except ValueError as e:
        raise ModelError(f"--quantize {name!r}: {e} (or one of {', '.join(FORMATS)})") from None


def quantizable(name: str, t: torch.Tensor, fmt) -> bool:
    """Whether mlx-lm's default would quantize tensor `name`: a float `.weight` of a linear or an embedding (2-D),
    or an MoE layer's expert stack (3-D), whose rows split into groups."""
    return (name.endswith(".weight") and (t.dim() == 2 or (t.dim() == 3 and ".switch_mlp." in name))
            and t.is_floating_point() and t.shape[-1] % fmt.group_size == 0
            and not name.endswith(".mixer.gate.weight"))    # nemotron-3's router: mlx-lm's is a bare parameter


def quantize(t: torch.Tensor, fmt):
    from kilnx.quant import QWeight
    w = t if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else t.float()
    return QWeight.quantize(w, mode=fmt.mode, bits=fmt.bits, group_size=fmt.group_size)


# HF stores an MoE layer's experts one by one; mlx-lm (and kilnx's MoE kernels) take them stacked (E, N, K) under
# `switch_mlp`: (HF projection name, stacked name) by block
_EXPERT_NAMES = {"mlp": (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                 "block_sparse_moe": (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")),
                 "mixer": (("up_proj", "fc1"), ("down_proj", "fc2"))}     # nemotron-3's ungated experts
_EXPERT = re.compile(r"^((?:model|backbone)\.layers\.\d+)\.(mlp|block_sparse_moe|mixer)\.experts\.(\d+)\.(\w+)\.weight$")
# granite 4.0 h stores each MoE layer's experts already stacked, gate and up fused: input_linear (E, 2F, H) [gate |
# up] and output_linear (E, H, F), which mlx-lm's sanitize splits into the same switch_mlp stacks
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe)\.(input|output)_linear\.weight$")


class StackedExperts:
    """A WeightSource that shows an HF checkpoint's one-by-one experts as mlx-lm's stacks: for each MoE layer
    `<block>.switch_mlp.{gate,up,down}_proj.weight` (E, N, K), as mlx-lm's sanitize joins them."""

    def __init__(self, inner):
        self.inner, self.path = inner, inner.path
        self._parts: dict[str, list[str]] = {}
        self._hidden: set[str] = set()
        for name in inner.names():
            m = _EXPERT.match(name)
            if m and m.group(4) in dict(_EXPERT_NAMES[m.group(2)]):
                stacked = f"{m.group(1)}.{m.group(2)}.switch_mlp.{dict(_EXPERT_NAMES[m.group(2)])[m.group(4)]}.weight"
                self._parts.setdefault(stacked, []).append(name)
                self._hidden.add(name)
        for stacked, parts in self._parts.items():   # in expert order (names sort 10 before 2)
            parts.sort(key=lambda n: int(_EXPERT.match(n).group(3)))
        self._halves: dict[str, tuple[str, int | None]] = {}    # stacked name -> (fused name, half or None: whole)
        for name in inner.names():
            m = _FUSED_EXPERTS.match(name)
            if m:
                at = m.group(1) + ".switch_mlp."
                if m.group(2) == "input":
                    self._halves[at + "gate_proj.weight"], self._halves[at + "up_proj.weight"] = (name, 0), (name, 1)
                else:
                    self._halves[at + "down_proj.weight"] = (name, None)
                self._hidden.add(name)

    def names(self) -> list[str]:
        return sorted([n for n in self.inner.names() if n not in self._hidden] + list(self._parts) + list(self._halves))

    def has(self, name: str) -> bool:
        return name in self._parts or name in self._halves or (self.inner.has(name) and name not in self._hidden)

    def linears(self, names: list[str]) -> list:
        return [self._linear(n) for n in names]

    def _linear(self, name: str):
        if name in self._parts:
            return torch.stack(self.inner.linears(self._parts[name]))
        if name in self._halves:
            fused, half = self._halves[name]
            w = self.inner.linears([fused])[0]
            return w if half is None else w.chunk(2, dim=1)[half].contiguous()
        return self.inner.linears([name])[0]

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def module_format(module: str, fmt, arch: str):
    """The format mlx-lm's own predicate gives a module: qwen3-moe and granite keep their routers at 8 bits."""
    from kilnx.quant.qweight import QuantFormat
    if ((arch == "qwen3_moe" and module.endswith("mlp.gate")) or (arch == "granitemoehybrid" and module.endswith(
            "router.layer"))) and fmt.mode == "affine":
        return QuantFormat("affine", 8, 64)
    return fmt


class QuantizingSource:
    """A WeightSource whose dense linears come out quantized in `fmt` (what --quantize loads); everything else,
    and linears the source already holds quantized, as the inner source gives them."""

    def __init__(self, inner, fmt, arch: str = ""):
        self.inner, self.fmt, self.arch = inner, fmt, arch
        self.path = inner.path

    def linears(self, names: list[str]) -> list:
        out = []
        for n, w in zip(names, self.inner.linears(names)):
            fmt = module_format(n.rsplit(".", 1)[0], self.fmt, self.arch)
            out.append(quantize(w, fmt) if isinstance(w, torch.Tensor) and quantizable(n, w, fmt) else w)
        return out

    def __getattr__(self, attr):            # the rest of the source's interface: has, dense, GGUF metadata ...
        return getattr(self.inner, attr)


def _mlx_tensors(module: str, q) -> dict[str, torch.Tensor]:
    """A QWeight as mlx-lm stores it: `.weight` uint32 words, `.scales`, and `.biases` (affine)."""
    out = {f"{module}.weight": q.packed.contiguous().view(torch.uint32), f"{module}.scales": q.scales.contiguous()}
    if q.biases is not None:
        out[f"{module}.biases"] = q.biases.contiguous()
    return out


def _format_entry(fmt) -> dict:
    entry = {"group_size": fmt.group_size, "bits": fmt.bits}
    return entry if fmt.mode == "affine" else {**entry, "mode": fmt.mode}


def convert(model: str, out_dir: str, fmt, *, progress=None) -> dict:
    """Write `model` (a safetensors directory, HF or MLX, or a GGUF file) quantized in `fmt` to out_dir as an MLX-format
    directory.
    out_dir must not exist (or be empty); it is written under a temporary name and renamed when complete, so an
    interrupted conversion leaves nothing behind. Returns {"quantized", "kept", "files"} counts."""
    from kilnx.models.loaders import _looks_gguf, resolve_path
    from kilnx.models.loaders.safetensors_loader import load_safetensors_dir, read_hf_config
    path = resolve_path(model)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ModelError(f"{out_dir}: already exists; give a new directory (convert never overwrites)")
    if os.path.isdir(path):
        hf = read_hf_config(path)
        cfg, src = load_safetensors_dir(path)   # checks the architecture is one kilnx runs
        src = StackedExperts(src)
    elif path.endswith(".gguf") or _looks_gguf(path):
        from kilnx.models.gguf_convert import GGUFAsHF
        src = GGUFAsHF(path)
        hf, cfg = src.hf_config(), src.config
    else:
        raise ModelError(f"{model}: kilnx convert reads safetensors directories (HF or MLX) and GGUF files")
    names = [n for n in src.names() if not (n == "lm_head.weight" and hf.get("tie_word_embeddings"))]
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out_dir))}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        counts = _write(src, names, tmp, fmt, hf, cfg.arch, path, progress)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)                  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def _write(src, names, tmp, fmt, hf, arch, path, progress) -> dict:
    from safetensors.torch import save_file

    shard, shard_bytes, shards, weight_map = {}, 0, [], {}
    overrides, quantized, kept = {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, os.path.join(tmp, name), metadata={"format": "mlx"})
            shards.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        stored_quantized = src.has(f"{module}.scales") and src.has(f"{module}.weight")
        if stored_quantized and leaf != "weight":
            continue                           # its .scales / .biases go with its .weight
        (t,) = src.linears([name])             # a QWeight where the module is stored quantized
        if not isinstance(t, torch.Tensor):
            tensors = _mlx_tensors(module, t)
            if t.format != fmt:
                overrides[module] = _format_entry(t.format)
            kept += 1
        elif quantizable(name, t, own := module_format(module, fmt, arch)):
            tensors = _mlx_tensors(module, quantize(t, own))
            if own != fmt:
                overrides[module] = _format_entry(own)
            quantized += 1
        else:
            tensors = {name: t.contiguous()}
        for k, t in tensors.items():
            shard[k] = t
            shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    if progress is not None:
        progress(len(names), len(names), "")
    if len(shards) == 1:
        os.replace(os.path.join(tmp, shards[0]), os.path.join(tmp, "model.safetensors"))
        shards = ["model.safetensors"]
    else:
        final = {}
        for j, s in enumerate(shards):
            new = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(os.path.join(tmp, s), os.path.join(tmp, new))
            final[s] = new
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}, f, indent=2)
    config = {k: v for k, v in hf.items() if k not in ("quantization", "quantization_config")}
    config["quantization"] = config["quantization_config"] = {**_format_entry(fmt), **overrides}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if not os.path.isdir(path):               # a GGUF: its vocabulary as tokenizer.json
        src.write_tokenizer(tmp)
    for entry in os.listdir(path) if os.path.isdir(path) else ():   # tokenizer, chat template, generation config ...
        full = os.path.join(path, entry)
        if os.path.isfile(full) and not entry.endswith(".safetensors") and entry not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(full, os.path.join(tmp, entry))
    if quantized == 0 and kept == 0:
        raise CheckpointError(f"{path}: no weight of it could be quantized in groups of {fmt.group_size}")
    return {"quantized": quantized, "kept": kept, "files": len(shards)}
