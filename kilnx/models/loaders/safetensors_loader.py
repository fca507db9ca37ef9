"""Safetensors directories: HF checkpoints (dense bf16/fp16/fp32) and MLX ones (mlx-lm's quantized layout).

An MLX directory's config.json carries "quantization": {"group_size", "bits", "mode"?} plus
per-module overrides keyed by module path ({"bits", "group_size"} or false for "left dense"). A
quantized module stores `<name>.weight` (packed uint32 words), `<name>.scales` and `<name>.biases`.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from kilnx.models.config import ModelConfig, from_hf
from kilnx.models.errors import CheckpointError


class SafetensorsSource:
    """WeightSource over every *.safetensors file of a directory, answering by HF tensor name."""

    def __init__(self, path: str, hf_config: dict):
        from safetensors import safe_open
        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files; the directory must hold the model's weights.")
        self._where: dict[str, str] = {}
        self._handles = {}
        for f in files:
            try:
                h = safe_open(f, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{f}: not a readable safetensors file ({e}); re-download it.") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        q = hf_config.get("quantization") or hf_config.get("quantization_config")
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method is not None:     # HF's quantized formats name theirs; MLX's (mlx-lm's config) names none
            raise CheckpointError(f"{path}: a {method} checkpoint; kilnx reads dense, MLX and GGUF weights, not "
                                  f"{method}'s. Use the dense model (add --quantize q4, or `kilnx convert` it once) "
                                  "or an MLX / GGUF quantization of it.")
        self.quant = q if (isinstance(q, dict) and "bits" in q) else None

    def _get(self, key: str) -> torch.Tensor:
        try:
            return self._handles[self._where[key]].get_tensor(key)
        except KeyError:
            raise CheckpointError(f"{self.path}: missing tensor {key!r}; the checkpoint is incomplete.") from None
        except Exception as e:  # noqa: BLE001 - a short read surfaces as a safetensors error
            raise CheckpointError(f"{self._where.get(key)}: cannot read {key!r} ({e}); the file is truncated "
                                  f"or corrupt — re-download it.") from None

    def has(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name of the directory's files, sorted."""
        return sorted(self._where)

    def _module_quant(self, name: str):
        """(bits, group_size, mode) of the module owning tensor `name`, or None when it is dense."""
        if self.quant is None:
            return None
        module = name.rsplit(".", 1)[0]
        if module + ".scales" not in self._where:
            return None
        override = self.quant.get(module)
        if isinstance(override, dict):
            return (override.get("bits", self.quant["bits"]), override.get("group_size", self.quant["group_size"]),
                    override.get("mode", self.quant.get("mode", "affine")))
        return self.quant["bits"], self.quant["group_size"], self.quant.get("mode", "affine")

    def _qweight(self, name: str):
        from kilnx.quant import QWeight
        bits, gs, mode = self._module_quant(name)
        module = name.rsplit(".", 1)[0]
        biases = self._get(module + ".biases") if module + ".biases" in self._where else None
        return QWeight.from_mlx(self._get(name), self._get(module + ".scales"), biases,
                                mode=mode, bits=bits, group_size=gs)

    def dense(self, name: str) -> torch.Tensor:
        if self._module_quant(name) is not None:
            return self._qweight(name).dequantize().float()
        return self._get(name).float()

    def linears(self, names: list[str]) -> list:
        return [self._qweight(n) if self._module_quant(n) is not None else self._get(n) for n in names]


def read_hf_config(path: str) -> dict:
    cj = os.path.join(path, "config.json")
    if not os.path.isfile(cj):
        raise CheckpointError(f"{path}: no config.json; a model directory needs config.json, tokenizer.json "
                              f"and *.safetensors.")
    try:
        with open(cj) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cj}: invalid JSON ({e}); restore the file from the model's repository.") from None


def load_safetensors_dir(path: str) -> tuple[ModelConfig, SafetensorsSource]:
    hf = read_hf_config(path)
    cfg = from_hf(hf, os.path.join(path, "config.json"))
    cfg.check_supported(path)
    return cfg, SafetensorsSource(path, hf)
