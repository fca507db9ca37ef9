"""What an fp8 KV cache costs in quality: a text's perplexity under each --kv-cache-dtype, and per position the
KL divergence from the full-width cache's next-token distribution and whether the top token is the same.

  python bench/probes/kv_quality.py OUT_CSV [MODEL] [TOKENS] [TEXT_FILE] [DEVICE]
  (defaults: smollm2-135m, 1024 tokens, this repository's README.md, auto)

Every position's logits come from one prefill (Engine.prefill_logits), whose attention reads the keys and values
back from the cache it wrote (so each position sees all earlier ones in the cache's dtype).
"""
from __future__ import annotations

import csv
import datetime
import os
import sys

import torch

from kilnx.models.loaders import load_model
from kilnx.runtime.device import detect
from kilnx.runtime.engine import Engine


def main(out: str, model: str = "smollm2-135m", tokens: int = 1024, text_file: str | None = None,
         device: str = "auto"):
    info = detect(device)
    lm = load_model(model, device=info.torch_device)
    text_file = text_file or os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    ids = lm.tokenizer.encode(open(text_file).read())[:tokens]
    target = torch.tensor(ids[1:], device=lm.model.device)
    rows, base = [], None
    for kv in ("auto", "fp8"):
        engine = Engine(lm.model, max_seq=len(ids) + 1, kv_cache_dtype=kv, cuda_graphs=False)
        logp = torch.log_softmax(engine.prefill_logits(ids)[:-1].float(), dim=-1)
        nll = -logp.gather(1, target[:, None]).mean().item()
        if base is None:
            base, kl, agree = logp, 0.0, 1.0
        else:
            kl = (base.exp() * (base - logp)).sum(-1).mean().item()
            agree = (logp.argmax(-1) == base.argmax(-1)).float().mean().item()
        rows.append([model, kv, str(engine.cache.k[0].dtype).replace("torch.", ""), len(ids), f"{torch.tensor(nll).exp():.4f}",
                     f"{kl:.5f}", f"{agree:.4f}", engine.cache.bytes_per_token()])
        print(*rows[-1], flush=True)
    import triton
    stamp = [info.name, torch.__version__, triton.__version__, os.environ.get("KILNX_COMMIT", "unknown"),
             datetime.date.today().isoformat()]
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "kv_cache_dtype", "cache_dtype", "tokens", "perplexity", "kl_vs_auto", "top1_agree",
                    "kv_bytes_per_token", "device", "torch", "triton", "commit", "date"])
        w.writerows(r + stamp for r in rows)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "kv_quality.csv", a[1] if len(a) > 1 else "smollm2-135m", int(a[2]) if len(a) > 2 else 1024,
         a[3] if len(a) > 3 else None, a[4] if len(a) > 4 else "auto")
