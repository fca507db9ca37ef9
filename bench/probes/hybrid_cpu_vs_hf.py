"""nemotron-h on the CPU: kilnx (numba kernels, fp32) against HF transformers' NemotronH (its torch path) on the same
weights, in one process.

    python bench/probes/hybrid_cpu_vs_hf.py OUT_CSV [PROMPT_LEN] [GEN] [dense|moe]

A mid-size nemotron-h (hidden 1024, 12 layers M-M*-M-M-M*-, 32 Mamba heads of 32 channels with 64-wide states, 8
groups, vocab 32000; 121M parameters (counted)) with random weights in trained ranges, saved by transformers and loaded by
kilnx from that directory twice: dense fp32 as transformers runs it, and quantized to 4-bit groups of 64 as it loads
(`--quantize q4`, kilnx's CPU path; transformers' CPU path has no 4-bit). Greedy decoding of GEN tokens after a
PROMPT_LEN-token prompt, each twice, the second timed: prefill tok/s and decode tok/s. Torch threads as the machine
gives them to all.
`moe`: the same stack with nemotron-3's MoE layers in place of its MLPs (M E M * E ...; 32 relu² experts of 512, top 4,
sigmoid routing, a shared expert of 1024): kilnx runs its experts quantized only, so the dense kilnx row is left out.
"""
from __future__ import annotations

import csv
import os
import sys
import tempfile
import time

import torch

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, max_position_embeddings=4096,
              num_attention_heads=16, num_key_value_heads=4, head_dim=64, attention_bias=False, mamba_num_heads=32,
              mamba_head_dim=32, mamba_proj_bias=False, ssm_state_size=64, conv_kernel=4, n_groups=8, mlp_bias=False,
              layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hybrid_override_pattern="M-M*-M-M-M*-",
              tie_word_embeddings=False)
MOE = dict(CONFIG, hybrid_override_pattern="MEM*EMEMEM*E", n_routed_experts=32, num_experts_per_tok=4,
           moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024, n_shared_experts=1,
           routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True)


def hf_model(path: str, config: dict):
    import transformers
    cfg = transformers.NemotronHConfig(**config)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand_like(p) * 2 - 4)
            elif "norm" in name or name.endswith(".D"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "conv1d.weight" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif p.dim() >= 2:      # linears, an MoE layer's router and (transformers 5) its expert stacks
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def time_hf(model, ids, gen):
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        t1 = time.perf_counter()
        cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        toks = [tok]
        t2 = time.perf_counter()
        for _ in range(gen - 1):
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            toks.append(tok)
        t3 = time.perf_counter()
    return len(ids) / (t1 - t0), (gen - 1) / (t3 - t2), toks


def time_kilnx(model, ids, gen):
    from kilnx.runtime.engine import Engine
    eng = Engine(model, max_seq=len(ids) + gen + 8)
    t0 = time.perf_counter()
    tok = int(eng.prefill(ids).argmax())
    t1 = time.perf_counter()
    toks = [tok]
    for i in range(gen - 1):
        tok = int(eng.decode(torch.tensor([tok]), torch.tensor([len(ids) + i]))[0].argmax())
        toks.append(tok)
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), (gen - 1) / (t2 - t1), toks


def main(out: str, prompt_len: int = 128, gen: int = 32, kind: str = "dense"):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.bench import provenance
    config = MOE if kind == "moe" else CONFIG
    path = tempfile.mkdtemp(prefix="nemotron-h-")
    hf = hf_model(path, config)
    q4 = load_model(path, device="cpu", dtype=torch.float32, ops="auto", quantize="q4")
    ids = torch.randint(0, config["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    prov = provenance("cpu")
    rows = []
    runs = [("kilnx_q4", lambda: time_kilnx(q4.model, ids, gen)), ("hf_transformers_fp32", lambda: time_hf(hf, ids, gen))]
    if kind != "moe":
        dense = load_model(path, device="cpu", dtype=torch.float32, ops="auto")
        runs.insert(0, ("kilnx_fp32", lambda: time_kilnx(dense.model, ids, gen)))
    for name, run in runs:
        run()                                   # compiles, allocates
        prefill, decode, toks = run()
        rows.append((name, prefill, decode, toks))
        print(f"{name}: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s", flush=True)
    hf_row = rows[-1]
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "impl", "prompt_len", "gen", "prefill_tok_s", "decode_tok_s", "decode_ratio_vs_hf",
                    "greedy_tokens_as_hf", "threads", "device", "torch", "commit", "date"])
        for name, prefill, decode, toks in rows:
            same = sum(a == b for a, b in zip(toks, hf_row[3]))
            w.writerow([f"nemotron-h-{kind}", name, prompt_len, gen, f"{prefill:.1f}", f"{decode:.2f}", f"{decode / hf_row[2]:.2f}",
                        f"{same}/{gen}", torch.get_num_threads(), prov["gpu"], prov["torch"],
                        os.environ.get("KILNX_COMMIT", prov["commit"]), prov["date"]])


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]), *sys.argv[4:5])
