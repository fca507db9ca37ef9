"""Speculative decoding (runtime/speculative.py), measured two ways in one process:

1. `verify`: what a round costs against a decode step — Engine.verify over 1 + k tokens (k guesses) against one
   replayed decode step, k = 1..8, on any model (random weights are fine: the cost does not depend on them).
   With mean tokens kept per round E, speculation pays where E x t(step) / t(verify k) > 1.
2. `serve`: 1 and 4 requests at once through `kilnx serve`'s scheduler, up to 128 tokens each (to an end-of-text
   token), asked to repeat a text
   (a model with a tokenizer: the paragraph below, from a different sentence each; random weights: a random run
   four times, and their output then loops on its own): tok/s against plain serving (GPU lookahead on) in the same
   run for prompt lookup with rounds of up to 4 rows together (speculate_rows 4) and of a row alone (1), and with `--draft MODEL` a draft
   model (random: an unrelated model, so mostly wrong guesses — what rounds cost). The drafted / accepted / steps
   columns count the warm-up run too.
3. `repeat` (a real checkpoint with a tokenizer): a chat prompt asking to repeat a paragraph, decoded greedily
   plain and with prompt lookup (k = 2, 4, 6) — decode tok/s, its ratio to plain decoding in the same run, the
   guesses kept, and whether the tokens equal plain decoding's.

    python bench/probes/speculative.py OUT.csv [MODEL] [--random] [--draft MODEL]    (default smollm2-135m)

Each measurement runs once untimed first (compiles, recordings, graph captures), then `ROUNDS` times; the
median is reported.
"""

from __future__ import annotations

import csv
import statistics
import sys
import time

import torch

ROUNDS = 5
PARAGRAPH = ("The kiln was built in 1887 from local clay bricks. It fired pottery for the village until 1952, when "
             "the last potter retired. Restored in 1990, it now holds a small museum of glazes, tools and the "
             "ledgers in which each firing was written down: the date, the wood burned, and what broke.")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_costs(lm, device) -> list[dict]:
    from kilnx.runtime.engine import Engine
    engine = Engine(lm.model, max_seq=256)
    prompt = torch.randint(0, lm.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.prefill(prompt)
    tok, pos = torch.tensor([prompt[-1]], device=device), torch.tensor([64], device=device)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(ROUNDS):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            _sync(device)
            times.append((time.perf_counter() - t0) / 10)
        return statistics.median(times)

    step = timed(lambda: engine.decode(tok, pos, max_position=64))
    rows = [{"case": "decode_step", "k": 0, "ms": step * 1e3, "ratio_vs_step": 1.0}]
    for k in range(1, 9):
        t = timed(lambda: engine.verify(prompt[-1 - k:], start=64))
        rows.append({"case": f"verify_k{k}", "k": k, "ms": t * 1e3, "ratio_vs_step": t / step})
    return rows


def _serve_prompts(lm, count: int) -> list[list[int]]:
    """Prompts that ask for repetition: a chat asking to repeat the paragraph from its i-th sentence (a model with a
    tokenizer), or a random 32-token run four times (random weights: their output loops on its own)."""
    if lm.tokenizer is not None and lm.tokenizer.chat_template:
        from kilnx.runtime.generate import prompt_ids
        sentences = PARAGRAPH.split(". ")
        return [prompt_ids(lm, "Repeat this text exactly, word for word:\n\n" + ". ".join(sentences[i:] + sentences[:i]),
                           chat=True) for i in range(count)]
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, lm.config.vocab_size, (32,), generator=g).tolist() * 4 for _ in range(count)]


def serve_runs(lm, draft_lm) -> list[dict]:
    """1 and 4 requests at once through the scheduler (4 rows), 128 tokens each: plain, prompt lookup with
    rounds of every row decoding, prompt lookup with rounds of a row alone (speculate_rows 1), a draft model."""
    import threading

    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    from kilnx.runtime.speculative import DraftModel, PromptLookup
    params = SamplingParams(max_tokens=128)
    cases = [("serve_plain", None, 1), ("serve_prompt_lookup_k4_rows4", lambda: PromptLookup(4), 4),
             ("serve_prompt_lookup_k4_alone", lambda: PromptLookup(4), 1)]
    if draft_lm is not None:
        cases.append(("serve_draft_k4", lambda: DraftModel(draft_lm.model, 4), 1))
    rows = []
    for count in (1, 4):
        prompts, plain_rate = _serve_prompts(lm, count), None
        for case, make, most in cases:
            proposer = make() if make else None
            with Scheduler(Engine(lm.model, max_seq=512, max_batch=4), stop_token_ids=default_stop_ids(lm),
                           proposer=proposer, speculate_rows=most) as sched:
                rates = []
                for i in range(3 + 1):             # the first compiles and captures
                    left, done = [count], threading.Event()

                    def on_event(kind, _):
                        if kind == "done":
                            left[0] -= 1
                            if not left[0]:
                                done.set()
                    t0 = time.perf_counter()
                    reqs = [sched.submit(p, params, on_event) for p in prompts]
                    done.wait()
                    if i:
                        rates.append(sum(len(r.tokens) for r in reqs) / (time.perf_counter() - t0))
                drafted, accepted, steps = sched.drafted, sched.accepted, sched.steps
            rate = statistics.median(rates)
            plain_rate = plain_rate or rate
            rows.append({"case": f"{case}_requests{count}", "k": 4 if make else 0, "tok_s": rate,
                         "ratio_vs_plain": rate / plain_rate, "generated": sum(len(r.tokens) for r in reqs),
                         "drafted": drafted,
                         "accepted": accepted, "steps": steps})
    return rows


def repeat_runs(lm) -> list[dict]:
    from kilnx.runtime.generate import stream
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.speculative import PromptLookup
    prompt = f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}"
    params = SamplingParams(max_tokens=64)

    def once(k: int):
        *_, stats = stream(lm, prompt, params, chat=True, proposer=PromptLookup(k) if k else None)
        return stats

    rows, plain_ids, plain_rate = [], None, None
    for k in (0, 2, 4, 6):
        once(k)
        runs = [once(k) for _ in range(ROUNDS)]
        rate = statistics.median(r.decode_tok_s for r in runs)
        if k == 0:
            plain_ids, plain_rate = runs[0].token_ids, rate
        rows.append({"case": "plain" if k == 0 else f"prompt_lookup_k{k}", "k": k, "tok_s": rate,
                     "ratio_vs_plain": rate / plain_rate, "generated": runs[0].generated_tokens,
                     "drafted": runs[0].drafted, "accepted": runs[0].accepted,
                     "same_tokens": runs[0].token_ids == plain_ids})
    return rows


def main() -> None:
    from kilnx.models.loaders import load_model
    from kilnx.runtime.bench import provenance
    out = sys.argv[1]
    args = [a for i, a in enumerate(sys.argv[2:], 2) if not a.startswith("--") and sys.argv[i - 1] != "--draft"]
    model = args[0] if args else "smollm2-135m"
    random = "--random" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = load_model(model, device=device, random=random)
    prov = provenance(device)
    draft = sys.argv[sys.argv.index("--draft") + 1] if "--draft" in sys.argv else None
    draft_lm = load_model(draft, device=device, random=random) if draft else None
    rows = [{"part": "verify", **r} for r in verify_costs(lm, torch.device(device))]
    rows += [{"part": "serve", **r} for r in serve_runs(lm, draft_lm)]
    if lm.tokenizer is not None and not random:
        rows += [{"part": "repeat", **r} for r in repeat_runs(lm)]
    fields = ["part", "case", "k", "ms", "ratio_vs_step", "tok_s", "ratio_vs_plain", "generated", "drafted",
              "accepted", "steps", "same_tokens", "model", "gpu", "torch", "triton", "commit", "date"]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**r, "model": model, **prov})
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
