"""Where a decode step's time goes: a model (random 4-bit weights) decodes with CUDA graphs off, and
torch.profiler's CUDA-time table of 16 steps is printed (graphs on, each step replays the same kernels).
    python3 bench/profile_decode.py [llama-3.1-8b] [PROMPT_LEN=128] [MAX_SEQ=256] [KV_CACHE_DTYPE=auto|fp8]"""

from __future__ import annotations

import sys

import torch

from kilnx.models.loaders import load_model
from kilnx.runtime.engine import Engine

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 128
max_seq = int(sys.argv[3]) if len(sys.argv) > 3 else 256
kv = sys.argv[4] if len(sys.argv) > 4 else "auto"
lm = load_model(name, device="cuda", ops="auto", random=True, random_format="q4")
engine = Engine(lm.model, max_seq=max_seq, cuda_graphs=False, kv_cache_dtype=kv)
engine.prefill(list(range(1, prompt + 1)))
tok, pos = torch.tensor([5], device="cuda"), torch.tensor([prompt], device="cuda")
print(f"{name}: decode after a {prompt}-token prompt, cache of {max_seq} ({kv})")
for i in range(8):      # compiles and warms every kernel of a step
    engine.decode(tok, pos + i)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for i in range(16):
        engine.decode(tok, pos + 8 + i)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=50))
