"""Where a prefill's time goes: a model (random 4-bit weights) prefills a prompt a few times, the wall
time of each, then torch.profiler's CUDA-time table of one more.
    python3 bench/profile_prefill.py [L=2048] [MODEL=llama-3.1-8b]"""

from __future__ import annotations

import os
import sys
import time

import torch

from kilnx.models.loaders import load_model
from kilnx.runtime.bench import _run
from kilnx.runtime.engine import Engine
from kilnx.runtime.sampling import SamplingParams

L = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
lm = load_model(sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b", device="cuda", ops="auto", random=True,
                random_format="q4")
engine = Engine(lm.model, max_seq=L + 8)
ids = torch.randint(0, lm.config.vocab_size, (L,), generator=torch.Generator().manual_seed(0)).tolist()
one = SamplingParams(max_tokens=1, ignore_eos=True)
for i in range(4):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = _run(engine, ids, one)
    torch.cuda.synchronize()
    print(f"prefill {i}: {1e3 * (time.perf_counter() - t0):.1f} ms wall, ttft {1e3 * st.ttft_s:.1f} ms, "
          f"{st.prefill_tok_s:.0f} tok/s", flush=True)
if os.environ.get("PROFILE_HOST") == "1":      # where the host's time goes (cProfile of one more prefill)
    import cProfile
    import pstats
    host = cProfile.Profile()
    host.enable()
    _run(engine, ids, one)
    torch.cuda.synchronize()
    host.disable()
    pstats.Stats(host).sort_stats("tottime").print_stats(25)
    pstats.Stats(host).sort_stats("cumulative").print_stats(25)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    _run(engine, ids, one)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
