"""A GGUF file as an HF checkpoint, for `kilnx convert`: tensors under HF names in HF's conventions, the config
as config.json, the vocabulary as tokenizer.json. The codes stay what they are (GGUF Q4_0 / Q4_1 / Q8_0 are MLX
affine groups of 32 exactly; the K-quants as kilnx converts them, kilnx.quant.gguf_formats); F16 / F32 weights
are quantized in the format asked.

llama.cpp stores a llama-arch model's q / k rows permuted for its interleaved rotation; they are put back in HF's
order here (rows are independent, so a quantized weight's rows move with their scales and biases). Files whose
conventions are not mapped back are refused with the way out: llama 3's rope scaling stored as per-frequency
factors. Gemma's norms, stored as 1 + w, are written back as HF's w. MoE files (qwen3moe, mixtral as llama with
experts) keep their stacked experts as mlx-lm's `switch_mlp` stacks.
"""

from __future__ import annotations

import json
import os
import re

import torch

from kilnx.models.errors import ModelError

_HF_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
             "gemma3": "gemma3_text"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def _reverse_names(src) -> dict[str, str]:
    """HF name -> GGUF name of every tensor in the file (an MoE layer's under its arch's block, as mlx-lm's stacks)."""
    from kilnx.models.loaders.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES
    globals_back = {g: hf for hf, g in _GLOBAL_NAMES.items()}
    block = src.config.moe_block
    layer_back = {g: hf for hf, g in _LAYER_NAMES.items() if not hf.startswith(("mlp.gate.", "mlp.switch_mlp.",
                                                                                "block_sparse_moe."))}
    layer_back.update({g: hf for hf, g in _LAYER_NAMES.items() if hf.startswith(block + ".")
                       and hf.split(".")[1] in ("gate", "switch_mlp")})
    if src.config.arch == "gemma3":      # four norms a layer: after attention, before and after the MLP
        layer_back.update({"post_attention_norm.weight": "post_attention_layernorm.weight",
                           "ffn_norm.weight": "pre_feedforward_layernorm.weight"})
    else:
        layer_back["ffn_norm.weight"] = "post_attention_layernorm.weight"     # llama's pre-MLP norm
    out = {}
    for g in src.tensors:
        m = _LAYER.fullmatch(g)
        hf = f"model.layers.{m.group(1)}.{layer_back[m.group(2)]}" if m and m.group(2) in layer_back else \
            globals_back.get(g)
        if hf is None:
            raise ModelError(f"{src.path}: tensor {g!r} has no HF counterpart kilnx knows; convert the HF checkpoint")
        out[hf] = g
    return out


def hf_row_order(heads: int, head_dim: int) -> torch.Tensor:
    """Indices that put a llama.cpp-permuted q / k weight's rows back in HF's order: HF row (h, t, j) (t the half of
    the head, j the pair) is GGUF row (h, j, t)."""
    return torch.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def _rows(w, idx: torch.Tensor):
    from kilnx.quant import QWeight
    if isinstance(w, torch.Tensor):
        return w[idx]
    return QWeight(w.packed[idx], w.scales[idx], None if w.biases is None else w.biases[idx], format=w.format,
                   global_scale=w.global_scale, dtype=w.dtype)


class GGUFAsHF:
    """A WeightSource over a GGUF file in HF's names and conventions (module doc)."""

    def __init__(self, path: str):
        from kilnx.models.loaders.gguf_loader import GGUFSource
        src = GGUFSource(path)
        cfg = src.config
        cfg.check_supported(path)
        way_out = "convert the model's HF checkpoint instead, or run the GGUF as it is with --model"
        if cfg.arch not in _HF_TYPES:
            raise ModelError(f"{path}: kilnx convert maps llama / qwen2 / qwen3 (and their MoE) GGUF files back to HF's "
                             f"layout, not {cfg.arch}; {way_out}")
        if "rope_freqs.weight" in src.tensors:
            raise ModelError(f"{path}: its rope scaling is stored as per-frequency factors (llama 3), which config.json "
                             f"cannot state; {way_out}")
        self.src, self.config, self.path = src, cfg, path
        self._gguf = _reverse_names(src)

    def names(self) -> list[str]:
        return sorted(self._gguf)

    def has(self, name: str) -> bool:
        return name in self._gguf

    def linears(self, names: list[str]) -> list:
        out = []
        for n in names:
            (w,) = self.src.linears([n])
            if self.config.rope_interleaved and n.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                heads = self.config.num_heads if ".q_proj." in n else self.config.num_kv_heads
                w = _rows(w, hf_row_order(heads, self.config.head_dim))
            if self.config.arch == "gemma3" and n.endswith("norm.weight"):
                w = w - 1        # llama.cpp stores gemma's norms as 1 + w, HF (and mlx-lm) as w
            out.append(w)
        return out

    def hf_config(self) -> dict:
        c = self.config
        cfg = {"model_type": _HF_TYPES[c.arch], "architectures": [], "vocab_size": c.vocab_size,
               "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
               "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
               "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
               "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
               "tie_word_embeddings": not self.has("lm_head.weight"), "hidden_act": c.hidden_act,
               "attention_bias": self.has("model.layers.0.self_attn.q_proj.bias")}
        if c.arch == "gemma3":
            pattern = c.layer_types.index("full") + 1 if "full" in c.layer_types else c.num_layers + 1
            cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=c.query_pre_attn_scalar,
                       sliding_window=c.sliding_window, sliding_window_pattern=pattern,
                       layer_types=[f"{t}_attention" for t in c.layer_types], rope_local_base_freq=c.rope_local_theta,
                       attn_logit_softcapping=c.attn_logit_softcap, final_logit_softcapping=c.final_logit_softcap)
            del cfg["hidden_act"]
        if c.arch == "qwen3_moe":
            cfg.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, decoder_sparse_step=1,
                       moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                       mlp_only_layers=[])
        elif c.arch == "mixtral":
            cfg.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
        if c.rope_scaling:
            cfg["rope_scaling"] = dict(c.rope_scaling)
        if c.bos_token_id is not None:
            cfg["bos_token_id"] = c.bos_token_id
        if c.eos_token_ids:
            cfg["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
        return cfg

    def write_tokenizer(self, out_dir: str) -> None:
        """tokenizer.json (with BOS added by its post-processor where the file asks for it) and
        tokenizer_config.json (the chat template, the BOS / EOS strings)."""
        from kilnx.models.tokenizer import Tokenizer
        if not self.src.meta.get("tokenizer.ggml.tokens"):
            return
        tok = Tokenizer.from_gguf_metadata(self.src.meta, self.path)
        backend = tok.backend
        if tok.add_bos and tok.bos_token_id is not None:
            from tokenizers.processors import TemplateProcessing
            bos = backend.id_to_token(tok.bos_token_id)
            backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                        special_tokens=[(bos, tok.bos_token_id)])
        backend.save(os.path.join(out_dir, "tokenizer.json"))
        conf = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if tok.chat_template:
            conf["chat_template"] = tok.chat_template
        if tok.bos_token_id is not None:
            conf["bos_token"] = backend.id_to_token(tok.bos_token_id)
        if tok.eos_token_ids:
            conf["eos_token"] = backend.id_to_token(tok.eos_token_ids[0])
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(conf, f, indent=2)
