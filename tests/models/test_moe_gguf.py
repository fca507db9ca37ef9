"""MoE checkpoints in GGUF (llama.cpp's qwen3moe, and mixtral written as llama with experts) load as kilnx's
expert stacks and compute what an independent implementation computes on the same file: HF transformers reading
the qwen3-moe GGUF itself, and HF's Mixtral on the file's dequantized weights (q / k rows back in HF's order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

SIZES = dict(H=64, F=96, E=8, K=2, V=96, L=2, NH=4, NKV=2, D=16)
IDS = [1, 5, 7, 9, 11, 3, 40, 2]


@pytest.fixture(autouse=True)
def _numba_on_the_cpu(monkeypatch):
    """The models run on the numba lowering, not Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's row order for llama q / k: each head's halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path, arch: str, *, seed: int = 0, drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """A two-layer MoE GGUF of `arch` ("qwen3moe" or "llama" with experts), quantized as llama.cpp's mixes do
    (experts' gate / up Q4_0, down Q8_0, attention Q4_1, router and norms F32). Returns the weights as the file
    holds them, dequantized, in HF names and row order. `drop`: GGUF tensor names left out of the file."""
    s, rng = SIZES, np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": s["L"], "context_length": 256, "embedding_length": s["H"], "feed_forward_length": s["F"],
            "attention.head_count": s["NH"], "attention.head_count_kv": s["NKV"], "expert_count": s["E"],
            "expert_used_count": s["K"], "attention.key_length": s["D"], "attention.value_length": s["D"],
            "vocab_size": s["V"]}
    if arch == "qwen3moe":
        meta["expert_feed_forward_length"] = s["F"]
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 1e6)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    hf: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, shape, qtype=None, scale=0.1, heads=None):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if heads:                                           # llama-arch q / k: stored permuted
            x = _llama_cpp_permute(x, heads)
        if gguf_name in drop:
            stored = x
        elif qtype is None:
            w.add_tensor(gguf_name, x)
            stored = x
        else:
            data = quants.quantize(x, qtype)
            w.add_tensor(gguf_name, data, raw_dtype=qtype)
            stored = quants.dequantize(data, qtype).reshape(shape)
        hf[hf_name] = _llama_cpp_unpermute(stored, heads) if heads else stored

    H, F, E, NH, NKV, D = s["H"], s["F"], s["E"], s["NH"], s["NKV"], s["D"]
    llama = arch == "llama"
    add("token_embd.weight", "model.embed_tokens.weight", (s["V"], H), Q.Q8_0, 1.0)
    add("output_norm.weight", "model.norm.weight", (H,), None, 1.0)
    add("output.weight", "lm_head.weight", (s["V"], H), Q.Q8_0)
    for i in range(s["L"]):
        b, a = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", a + "input_layernorm.weight", (H,), None, 1.0)
        add(b + "ffn_norm.weight", a + "post_attention_layernorm.weight", (H,), None, 1.0)
        add(b + "attn_q.weight", a + "self_attn.q_proj.weight", (NH * D, H), Q.Q4_1, heads=NH if llama else None)
        add(b + "attn_k.weight", a + "self_attn.k_proj.weight", (NKV * D, H), Q.Q4_1, heads=NKV if llama else None)
        add(b + "attn_v.weight", a + "self_attn.v_proj.weight", (NKV * D, H), Q.Q4_1)
        add(b + "attn_output.weight", a + "self_attn.o_proj.weight", (H, NH * D), Q.Q4_1)
        if not llama:
            add(b + "attn_q_norm.weight", a + "self_attn.q_norm.weight", (D,), None, 1.0)
            add(b + "attn_k_norm.weight", a + "self_attn.k_norm.weight", (D,), None, 1.0)
        add(b + "ffn_gate_inp.weight", a + "mlp.gate.weight", (E, H), None, 1.0)
        add(b + "ffn_gate_exps.weight", a + "gate", (E, F, H), Q.Q4_0)
        add(b + "ffn_up_exps.weight", a + "up", (E, F, H), Q.Q4_0)
        add(b + "ffn_down_exps.weight", a + "mlp.experts.down_proj", (E, H, F), Q.Q8_0)
        hf[a + "mlp.experts.gate_up_proj"] = np.concatenate([hf.pop(a + "gate"), hf.pop(a + "up")], axis=1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _kilnx_logits(path, device="cpu"):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.kv_cache import KVCache
    lm = load_model(str(path), device=device, dtype=torch.float32)
    cache = KVCache.for_model(lm.config, 1, 32, device=device)
    with torch.no_grad():
        logits = lm.model.forward(torch.tensor([IDS], device=device), torch.arange(len(IDS), device=device)[None],
                                  cache)[0]
    return lm, logits.float().cpu().numpy()


def _greedy(lm, n: int) -> list[int]:
    """Prefill IDS, then n one-token decode steps (the MoE's decode kernels), greedy."""
    from kilnx.runtime.kv_cache import KVCache
    cache = KVCache.for_model(lm.config, 1, len(IDS) + n, device="cpu")
    x, pos, out = torch.tensor([IDS]), torch.arange(len(IDS))[None], []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(lm.model.forward(x, pos, cache, last=-1)[0, -1].argmax()))
            x, pos = torch.tensor([[out[-1]]]), pos[:, -1:] + 1
    return out


def _hf_greedy(model, n: int) -> tuple[np.ndarray, list[int]]:
    with torch.no_grad():
        ids = torch.tensor([IDS])
        logits = model(ids).logits[0].numpy()
        gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return logits, gen[0, len(IDS):].tolist()


def test_a_qwen3_moe_gguf_runs_as_transformers_runs_it(tmp_path):
    path = tmp_path / "qwen3moe.gguf"
    write_moe_gguf(path, "qwen3moe")
    # transformers' GGUF reader takes neither the experts' width nor (without a vocabulary) the vocab size
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, moe_intermediate_size=SIZES["F"],
        vocab_size=SIZES["V"])
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.norm_topk_prob
    want, want_tokens = _hf_greedy(model, 8)
    lm, got = _kilnx_logits(path)
    assert lm.config.arch == "qwen3_moe" and lm.config.norm_topk_prob and lm.config.vocab_size == SIZES["V"]
    layer = lm.model.weights.layers[0]
    assert tuple(layer.experts_gate_up.shape) == (SIZES["E"], 2 * SIZES["F"], SIZES["H"])
    assert (layer.experts_gate_up.bits, layer.experts_down.bits) == (4, 8)    # Q4_0 / Q8_0 kept, not dequantized
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert _greedy(lm, 8) == want_tokens


def test_a_mixtral_gguf_runs_as_transformers_mixtral_on_its_weights(tmp_path):
    """llama.cpp writes mixtral as arch llama with experts, q / k rows permuted for interleaved rotation."""
    path = tmp_path / "mixtral.gguf"
    weights = write_moe_gguf(path, "llama", seed=1)
    s = SIZES
    cfg = transformers.MixtralConfig(
        vocab_size=s["V"], hidden_size=s["H"], intermediate_size=s["F"], num_hidden_layers=s["L"],
        num_attention_heads=s["NH"], num_key_value_heads=s["NKV"], head_dim=s["D"], num_local_experts=s["E"],
        num_experts_per_tok=s["K"], rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    assert not missing and not unexpected
    want, want_tokens = _hf_greedy(model, 8)
    lm, got = _kilnx_logits(path)
    assert lm.config.arch == "mixtral" and lm.config.rope_interleaved and lm.config.moe_intermediate_size == s["F"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert _greedy(lm, 8) == want_tokens


def test_a_moe_gguf_without_its_experts_names_the_missing_tensor(tmp_path):
    from kilnx.models.errors import CheckpointError
    from kilnx.models.loaders import load_model
    path = tmp_path / "no_up.gguf"
    write_moe_gguf(path, "qwen3moe", drop=("blk.0.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"no_up\.gguf: missing tensor 'blk\.0\.ffn_up_exps\.weight'"):
        load_model(str(path))


@pytest.mark.gpu
def test_a_qwen3_moe_gguf_on_the_gpu_matches_the_cpu(tmp_path):
    """The GPU's MoE kernels (fp32 scales in groups of 32, 4-bit gate / up with 8-bit down) on the same file.
    An fp32 model's decode products on the GPU run in packed fp16 (kernels/qmv_h2.py, moe_h2.py: activations
    and each word's partial sums in fp16, before the affine offset is taken out): ~1e-3 of the largest output
    per product (qmv_h2's reference and Triton alike on 4- and 8-bit group-32 weights), and on the H100 the
    two-layer model's logits 0.45% of the largest from the CPU's (the torch peer on the GPU: 1.2e-6)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = tmp_path / "qwen3moe.gguf"
    write_moe_gguf(path, "qwen3moe")
    _, want = _kilnx_logits(path)
    _, got = _kilnx_logits(path, device="cuda")
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
