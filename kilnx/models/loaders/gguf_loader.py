"""GGUF checkpoints (llama.cpp's format): metadata -> ModelConfig, tensors -> QWeight or dense.

Quantized tensors go through kilnx.quant.from_gguf so they stay quantized; until that converter is
available they are dequantized with gguf's numpy reference. Two llama.cpp conventions matter:

* llama-arch q/k weights are stored permuted so llama.cpp can rotate adjacent pairs (2i, 2i+1)
  instead of HF's halves (i, i + D/2). Rather than un-permuting quantized rows, we rotate in the
  interleaved layout (config.rope_interleaved): q·k is unchanged because q and k are permuted alike.
* gemma norms are stored as 1 + w, so the GGUF config uses norm_weight_offset = 0.
* MoE experts are stored stacked (E, rows, cols) already (`ffn_{gate,up,down}_exps`), the router as
  `ffn_gate_inp`; mixtral is written as arch llama with an expert count.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from kilnx.models.config import ModelConfig, from_gguf_metadata
from kilnx.models.errors import CheckpointError
from kilnx.models.loaders.gguf_file import GGUFFile

_FIX = "re-download or re-convert the file (llama.cpp's convert_hf_to_gguf.py)"

# HF tensor name (suffix after model.layers.{i}.) -> GGUF name (suffix after blk.{i}.)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# MoE layers: the router and the expert stacks, which GGUF already keeps stacked (E, rows, cols)
for _block in ("mlp", "block_sparse_moe"):
    _LAYER_NAMES.update({f"{_block}.gate.weight": "ffn_gate_inp.weight",
                         f"{_block}.switch_mlp.gate_proj.weight": "ffn_gate_exps.weight",
                         f"{_block}.switch_mlp.up_proj.weight": "ffn_up_exps.weight",
                         f"{_block}.switch_mlp.down_proj.weight": "ffn_down_exps.weight"})
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "rope_freqs": "rope_freqs.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


class GGUFSource:
    """WeightSource over one GGUF file, answering by HF tensor name."""

    def __init__(self, path: str, config: ModelConfig | None = None):
        self.path = path
        self.file = GGUFFile(path)
        self.meta = self.file.meta
        self.tensors = self.file.tensors
        self.config = config or from_gguf_metadata(self.meta, path)
        if "output.weight" not in self.tensors:
            self.config = self.config.with_(tie_embeddings=True)
        if not self.config.vocab_size and "token_embd.weight" in self.tensors:   # no vocabulary in the metadata
            self.config = self.config.with_(vocab_size=self.tensors["token_embd.weight"].torch_shape[0])
        self._dense_cache: dict[str, torch.Tensor] = {}

    def gguf_name(self, hf_name: str) -> str:
        if hf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[hf_name]
        m = _LAYER_RE.fullmatch(hf_name)
        if not m:
            return hf_name
        i, rest = m.groups()
        if rest == "post_attention_layernorm.weight":
            # llama's post_attention_layernorm is its pre-MLP norm; gemma's is a real post-attention norm.
            g = "post_attention_norm.weight" if self.config.arch == "gemma3" else "ffn_norm.weight"
        else:
            g = _LAYER_NAMES.get(rest, rest)
        return f"blk.{i}.{g}"

    def has(self, name: str) -> bool:
        return self.gguf_name(name) in self.tensors

    def _tensor(self, name: str):
        g = self.gguf_name(name)
        if g not in self.tensors:
            raise CheckpointError(f"{self.path}: missing tensor {g!r} ({name}); {_FIX}.")
        return self.tensors[g]

    def dense(self, name: str) -> torch.Tensor:
        """fp32 tensor in HF orientation ((N, K) for matrices)."""
        if name not in self._dense_cache:
            self._dense_cache[name] = _dequantize(self._tensor(name))
        return self._dense_cache[name]

    def linears(self, names: list[str]) -> list:
        ts = [self._tensor(n) for n in names]
        if len(ts) > 1 and len({int(t.tensor_type) for t in ts}) == 1 and all(len(t.shape) >= 2 for t in ts):
            # Same ggml type: rows are independent blocks, so concatenating raw rows fuses exactly (per expert
            # for (E, rows, cols) stacks: the rows axis is the second last either way).
            raw = np.concatenate([np.asarray(t.data) for t in ts], axis=-2)
            shape = ts[0].torch_shape
            n = sum(t.torch_shape[-2] for t in ts)
            return [_convert(raw, ts[0].tensor_type, (*shape[:-2], n, shape[-1]))]
        if len(ts) == 1 and names[0] in self._dense_cache and not _is_quantized(ts[0]):
            return [self._dense_cache[names[0]]]
        return [_convert(np.asarray(t.data), t.tensor_type, t.torch_shape) for t in ts]


def _is_quantized(t) -> bool:
    import gguf
    return t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                 gguf.GGMLQuantizationType.BF16)


def _dequantize(t) -> torch.Tensor:
    import gguf
    arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(t.torch_shape)


def _convert(raw: np.ndarray, ggml_type, shape: tuple[int, ...]):
    """QWeight via kilnx.quant.from_gguf when available, else a dense fp32 tensor."""
    try:
        from kilnx.quant import from_gguf
    except ImportError:
        from_gguf = None
    if from_gguf is not None:
        try:
            return from_gguf(raw, ggml_type, shape)
        except NotImplementedError:
            pass
    import gguf
    arr = gguf.quants.dequantize(raw, ggml_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)


def load_gguf(path: str):
    """(ModelConfig, GGUFSource) for a GGUF file."""
    src = GGUFSource(path)
    src.config.check_supported(path)
    return src.config, src
