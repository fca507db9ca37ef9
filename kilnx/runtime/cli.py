"""`kilnx generate` and `kilnx bench`: typer command functions (registered by kilnx/cli.py).

User-facing failures (unknown model, damaged checkpoint, prompt too long, no GPU for --device cuda)
print one line on stderr and exit 1; only bugs show a traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer
from typing_extensions import Annotated

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run models with kilnx kernels.")

_KV_HELP = ("KV cache dtype: auto (the activations') or fp8 (e4m3: half the memory of bf16, rounded to nearest, "
            "as vLLM's fp8).")
_OPS_HELP = "Op implementations: kilnx (DSL kernels), torch (eager peer), auto (kilnx, torch where a kernel is missing)."


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


def _check_kv_cache_dtype(name: str) -> None:
    from kilnx.runtime.kv_cache import KV_CACHE_DTYPES
    if name not in KV_CACHE_DTYPES:
        _fail(f"--kv-cache-dtype {name!r}: use one of {', '.join(KV_CACHE_DTYPES)}.")


def _user_errors():
    from kilnx.models.errors import ModelError
    from kilnx.runtime.device import DeviceError
    from kilnx.runtime.mlx_peer import PeerUnavailable
    return (ModelError, DeviceError, PeerUnavailable)


def _parse_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        _fail(f"--prompt-lens {text!r}: give comma-separated integers, e.g. 128,2048.")
    if not lens or min(lens) < 1:
        _fail(f"--prompt-lens {text!r}: lengths must be positive integers.")
    return lens


def generate(
    model: Annotated[str, typer.Option(help="Model name (smollm2-135m, gemma-3-270m), .gguf file or safetensors dir.")],
    prompt: Annotated[str, typer.Option(help="Prompt text; - reads it from standard input.")],
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    system_prompt: Annotated[Optional[str], typer.Option(
        help="A system message before the prompt (implies --chat).")] = None,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option(
        help="Drop tokens less likely than this fraction of the likeliest one (0 = off).")] = 0.0,
    ops: Annotated[Optional[str], typer.Option(help=_OPS_HELP)] = None,
    quantize: Annotated[Optional[str], typer.Option(
        help="Quantize a dense checkpoint's linears as it loads: q4, q8, mxfp4, nvfp4 (kilnx convert writes them once).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=_KV_HELP)] = "auto",
    stats: Annotated[bool, typer.Option(help="Print timing after the text.")] = True,
    repetition_penalty: Annotated[float, typer.Option(
        help="Divide a prompt or output token's logit by this where positive, multiply where negative (1 = off).")] = 1.0,
    presence_penalty: Annotated[float, typer.Option(help="Subtract from a generated token's logit (OpenAI's).")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(
        help="Subtract per time a token was generated (OpenAI's).")] = 0.0,
    json_schema: Annotated[Optional[str], typer.Option(
        help="Constrain the output to this JSON schema (a file, or the schema itself; '{}' for any JSON object).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Constrain the output to this regular expression.")] = None,
    prompt_lookup: Annotated[bool, typer.Option(
        help="Speculative decoding, guessing from earlier in the text (vLLM's ngram method).")] = False,
    draft_model: Annotated[Optional[str], typer.Option(
        help="Speculative decoding, guessing with this smaller model of the same tokenizer.")] = None,
    num_draft_tokens: Annotated[int, typer.Option(help="Tokens guessed a speculative round.")] = 4,
) -> None:
    """Generate text from a prompt, streaming it as it is produced."""
    from kilnx.models.loaders import load_model
    from kilnx.runtime.device import detect
    from kilnx.runtime.generate import GenerationStats, prompt_ids, stream
    from kilnx.runtime.sampling import SamplingParams
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                max_tokens=max_tokens,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, grammar=_grammar(json_schema, regex))
    except ValueError as e:
        _fail(str(e))
    _check_kv_cache_dtype(kv_cache_dtype)
    try:
        info = detect(device)
        ops = ops or os.environ.get("KILNX_OPS", "auto")
        lm = load_model(model, device=info.torch_device, ops=ops, quantize=quantize, progress=True)
        proposer = _proposer(lm, info, ops, prompt_lookup, draft_model, num_draft_tokens, params)
        ids = prompt_ids(lm, sys.stdin.read() if prompt == "-" else prompt, chat=chat or system_prompt is not None,
                         system=system_prompt)
        if params.grammar is not None:
            return _generate_constrained(lm, ids, params, stats, kv_cache_dtype)
        result = None
        for item in stream(lm, ids, params, proposer=proposer, kv_cache_dtype=kv_cache_dtype):
            if isinstance(item, GenerationStats):
                result = item
            else:
                sys.stdout.write(item)
                sys.stdout.flush()
        sys.stdout.write("\n")
    except _user_errors() as e:
        _fail(str(e))
    if stats and result is not None:
        print(f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated ({result.stop_reason}); "
              f"TTFT {result.ttft_s * 1e3:.0f} ms, prefill {result.prefill_tok_s:.1f} tok/s, "
              f"decode {result.decode_tok_s:.1f} tok/s on {info.name}"
              + (f"; {result.accepted} of {result.drafted} guesses kept" if proposer is not None else "") + "]",
              file=sys.stderr)


def _proposer(lm, info, ops, prompt_lookup: bool, draft_model: str | None, num_draft: int, params):
    """--prompt-lookup / --draft-model as a speculative proposer (runtime/speculative.py), or None."""
    if not prompt_lookup and draft_model is None:
        return None
    from kilnx.runtime import speculative as S
    if prompt_lookup and draft_model is not None:
        _fail("give --prompt-lookup or --draft-model, not both.")
    if params is not None and params.grammar is not None:
        _fail("speculative decoding does not take --json-schema / --regex: drop one.")
    if num_draft < 1:
        _fail("--num-draft-tokens must be at least 1.")
    if prompt_lookup:
        return S.PromptLookup(num_draft)
    from kilnx.models.loaders import load_model
    draft = load_model(draft_model, device=info.torch_device, ops=ops)
    try:
        S.check_draft(lm, draft)
    except ValueError as e:
        _fail(str(e))
    return S.DraftModel(draft.model, num_draft)


def _grammar(json_schema: str | None, regex: str | None) -> str | None:
    """--json-schema / --regex as the grammar structured output follows (runtime/structured.py)."""
    if json_schema is None and regex is None:
        return None
    if json_schema is not None and regex is not None:
        _fail("give --json-schema or --regex, not both.")
    import json
    from kilnx.runtime import structured as S
    if regex is not None:
        return S.regex_grammar(regex)
    text = json_schema
    if os.path.isfile(json_schema):
        with open(json_schema) as f:
            text = f.read()
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        _fail(f"--json-schema: neither a file nor JSON ({e}).")
    return S.json_object_grammar() if schema == {} else S.json_schema_grammar(schema)


def _generate_constrained(lm, ids: list[int], params, stats: bool, kv_cache_dtype: str) -> None:
    """A grammar's tokens advance its matcher on the host: generated on a one-row scheduler (runtime/structured.py)."""
    import time
    from kilnx.runtime.chat import print_stream
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    from kilnx.runtime.scheduler import Scheduler
    engine = Engine(lm.model, max_seq=min(lm.config.max_position_embeddings, len(ids) + params.max_tokens + 1),
                    kv_cache_dtype=kv_cache_dtype)
    t0 = time.perf_counter()
    with Scheduler(engine, lm.tokenizer, stop_token_ids=default_stop_ids(lm)) as sched:
        print_stream(sched.stream(ids, params), (lambda f: f"[{f.prompt_tokens} prompt tokens, {f.completion_tokens} "
                     f"generated ({f.reason}) under the grammar in {time.perf_counter() - t0:.2f} s]") if stats else None)


def bench(
    model: Annotated[str, typer.Option(help="Model name, preset (with --random), .gguf file or safetensors dir.")],
    random: Annotated[bool, typer.Option(help="Random weights at the preset's real size (any preset).")] = False,
    prompt_lens: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "128,2048",
    gen: Annotated[int, typer.Option(help="Tokens to decode per prompt.")] = 128,
    repeats: Annotated[int, typer.Option(help="Measured runs per prompt length; each figure is their median.")] = 3,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    csv: Annotated[Optional[str], typer.Option(help="Append result rows to this CSV file.")] = None,
    weights: Annotated[str, typer.Option(help="Random weight format: q4 (MLX 4-bit, groups of 64) or bf16.")] = "q4",
    ops: Annotated[Optional[str], typer.Option(help=_OPS_HELP)] = None,
    quantize: Annotated[Optional[str], typer.Option(
        help="Quantize a dense checkpoint's linears as it loads: q4, q8, mxfp4, nvfp4 (kilnx convert writes them once).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=_KV_HELP)] = "auto",
    peer: Annotated[Optional[str], typer.Option(
        help="Also time a peer in the same run: hf (HF transformers on the same checkpoint, CPU) or mlx "
             "(mlx-lm on the same preset, random 4-bit gs64 weights; with --random).")] = None,
    threads: Annotated[Optional[int], typer.Option(
        help="CPU threads for torch and numba (kilnx and the peer alike); default: as configured.")] = None,
    batch: Annotated[int, typer.Option(
        help="Sequences decoded together (each prompt length, B prompts): decode tok/s summed over them, "
             "TTFT until every one has its first token.")] = 1,
) -> None:
    """Measure TTFT, prefill and decode throughput, and % of the memory-bandwidth roofline."""
    from rich.console import Console
    from rich.table import Table

    from kilnx.models.backend import ops_name
    from kilnx.models.loaders import load_model
    from kilnx.runtime.bench import append_csv, run_bench, weights_label
    from kilnx.runtime.device import detect
    lens = _parse_lens(prompt_lens)
    if gen < 1:
        _fail("--gen must be at least 1.")
    if repeats < 1:
        _fail("--repeats must be at least 1.")
    if weights not in ("q4", "bf16"):
        _fail(f"--weights {weights!r}: use q4 or bf16.")
    if peer not in (None, "hf", "mlx"):
        _fail(f"--peer {peer!r}: the peers are hf and mlx.")
    if batch < 1:
        _fail("--batch must be at least 1.")
    _check_kv_cache_dtype(kv_cache_dtype)
    if batch > 1 and peer:
        _fail("--peer times one sequence: use it without --batch.")
    if peer == "mlx" and (not random or weights != "q4"):
        _fail("--peer mlx builds the preset in mlx-lm with random 4-bit weights: use it with --random "
              "(and --weights q4).")
    if threads is not None:
        if threads < 1:
            _fail("--threads must be at least 1.")
        _set_threads(threads)
    try:
        info = detect(device)
        lm = load_model(model, device=info.torch_device, ops=ops or os.environ.get("KILNX_OPS", "auto"), progress=True,
                        random=random, random_format=weights, quantize=quantize)
        rows = run_bench(lm, prompt_lens=lens, gen=gen, model_name=model,
                         weights=weights_label(lm, random, weights), ops_name=ops_name(lm.model.ops),
                         bandwidth_gbps=info.copy_bandwidth_gbps, repeats=repeats, batch=batch,
                         kv_cache_dtype=kv_cache_dtype)
        if peer == "hf":
            if random:
                _fail("--peer hf needs a real checkpoint (not --random).")
            from kilnx.runtime.hf_peer import run_hf_bench
            rows += run_hf_bench(lm.source, vocab_size=lm.config.vocab_size, prompt_lens=lens, gen=gen,
                                 model_name=model, weights=rows[0].weights,
                                 bandwidth_gbps=rows[0].copy_bandwidth_gbps, repeats=repeats)
        if peer == "mlx":
            from kilnx.runtime.mlx_peer import run_mlx_bench
            rows += run_mlx_bench(lm.config, prompt_lens=lens, gen=gen, model_name=model,
                                  bandwidth_gbps=rows[0].copy_bandwidth_gbps, repeats=repeats)
    except _user_errors() as e:
        _fail(str(e))
    table = Table(title=f"{model} on {info.name} ({rows[0].ops} ops, {rows[0].weights}, "
                        f"{rows[0].weight_bytes / 1e6:.0f} MB weights, copy {rows[0].copy_bandwidth_gbps:.0f} GB/s"
                        + (f", {kv_cache_dtype} KV cache" if kv_cache_dtype != "auto" else "") + ")")
    for col in ("ops", "batch", "prompt", "gen", "TTFT ms", "prefill tok/s", "decode tok/s", "roofline %"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.ops, str(r.batch), str(r.prompt_len), str(r.gen), f"{r.ttft_ms:.1f}",
                      f"{r.prefill_tok_s:.1f}", f"{r.decode_tok_s:.1f}", f"{r.roofline_pct:.1f}")
    Console().print(table)
    for ours, theirs in zip(rows, [r for r in rows if r.ops in ("hf-transformers", "mlx-lm")]):
        print(f"decode at prompt {ours.prompt_len}: {ours.ops} {ours.decode_tok_s:.1f} tok/s = "
              f"{ours.decode_tok_s / theirs.decode_tok_s:.2f}x {theirs.ops} ({theirs.decode_tok_s:.1f} tok/s)")
    if csv:
        append_csv(csv, rows)


def serve(
    model: Annotated[str, typer.Option(help="Model name, preset (with --random), .gguf file or safetensors dir.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Sequences decoded together (cache rows).")] = 8,
    max_seq: Annotated[Optional[int], typer.Option(
        help="Context per sequence, prompt and output together (default: the model's, at most 4096).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model id clients send (default: --model).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    ops: Annotated[Optional[str], typer.Option(help=_OPS_HELP)] = None,
    quantize: Annotated[Optional[str], typer.Option(
        help="Quantize a dense checkpoint's linears as it loads: q4, q8, mxfp4, nvfp4 (kilnx convert writes them once).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=_KV_HELP)] = "auto",
    random: Annotated[bool, typer.Option(help="Random weights at the preset's real size (any preset).")] = False,
    weights: Annotated[str, typer.Option(help="Random weight format: q4 (MLX 4-bit, groups of 64) or bf16.")] = "q4",
    api_key: Annotated[Optional[str], typer.Option(
        envvar="KILNX_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 routes (default: open).")] = None,
    chat_template: Annotated[Optional[str], typer.Option(
        help="A Jinja chat template (a file, or the template itself) to use instead of the checkpoint's.")] = None,
    prefix_slots: Annotated[Optional[int], typer.Option(
        help="Sequences' K/V kept beyond the rows for prompts that begin with them, e.g. conversations' next "
             "turns (default: --max-batch; 0: off).")] = None,
    prompt_lookup: Annotated[bool, typer.Option(
        help="Speculative decoding while one request decodes, guessing from earlier in its text (vLLM's ngram).")] = False,
    draft_model: Annotated[Optional[str], typer.Option(
        help="Speculative decoding while one request decodes, guessing with this smaller model of the same "
             "tokenizer.")] = None,
    num_draft_tokens: Annotated[int, typer.Option(help="Tokens guessed a speculative round.")] = 4,
    speculative_max_rows: Annotated[int, typer.Option(
        help="Speculative rounds while at most this many requests decode, checked together in one forward "
             "(prompt lookup; a draft model: 1).")] = 1,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, batching concurrent requests."""
    try:
        from kilnx.runtime.server import Server, serve_forever
    except ImportError as e:
        _fail(f"kilnx serve needs fastapi and uvicorn ({e}); install them with: pip install 'kilnx[serve]'.")
    from kilnx.models.loaders import load_model
    from kilnx.runtime.device import detect
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    from kilnx.runtime.scheduler import Scheduler
    import torch
    if max_batch < 1:
        _fail("--max-batch must be at least 1.")
    if max_seq is not None and max_seq < 2:
        _fail("--max-seq must be at least 2.")
    if speculative_max_rows < 1:
        _fail("--speculative-max-rows must be at least 1.")
    if prefix_slots is not None and prefix_slots < 0:
        _fail("--prefix-slots must be 0 or more.")
    if not 0 <= port < 65536:
        _fail(f"--port {port}: give a port number from 0 to 65535.")
    if weights not in ("q4", "bf16"):
        _fail(f"--weights {weights!r}: use q4 or bf16.")
    _check_kv_cache_dtype(kv_cache_dtype)
    try:
        info = detect(device)
        ops = ops or os.environ.get("KILNX_OPS", "auto")
        lm = load_model(model, device=info.torch_device, ops=ops, random=random, random_format=weights, progress=True,
                        quantize=quantize)
        engine = Engine(lm.model, max_seq=max_seq or min(lm.config.max_position_embeddings, 4096), max_batch=max_batch,
                        kv_cache_dtype=kv_cache_dtype)
        proposer = _proposer(lm, info, ops, prompt_lookup, draft_model, num_draft_tokens, None)
    except _user_errors() as e:
        _fail(str(e))
    if chat_template is not None:
        if lm.tokenizer is None:
            _fail("--chat-template: this model has no tokenizer to render it with.")
        lm.tokenizer.chat_template = open(chat_template).read() if os.path.isfile(chat_template) else chat_template
    name = served_model_name or model
    slots = max_batch if prefix_slots is None else prefix_slots
    try:
        scheduler = Scheduler(engine, lm.tokenizer, stop_token_ids=default_stop_ids(lm), prefix_slots=slots,
                              proposer=proposer, speculate_rows=speculative_max_rows)
    except torch.OutOfMemoryError:
        _fail(f"no memory for {slots} kept prefixes of {engine.max_seq} tokens; lower --prefix-slots or --max-seq.")
    print(f"kilnx: serving {name} on {info.name} at http://{host}:{port}/v1 "
          f"({max_batch} rows of {engine.max_seq} tokens in a {engine.cache.nbytes / 2**30:.2f} GiB "
          f"{str(engine.cache.k[0].dtype).replace('torch.', '')} KV cache, {slots} kept prefixes"
          + (f", speculative rounds of {num_draft_tokens} guesses while at most {speculative_max_rows} request(s) "
             "decode" if proposer else "")
          + ")", file=sys.stderr)
    try:
        serve_forever(Server(lm, scheduler, name, api_key=api_key), host, port)
    finally:
        scheduler.close()


def _set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)
    from kilnx.codegen.numba_launch import numba_threads_set
    numba_threads_set(n)


app.command()(generate)
app.command()(bench)
app.command()(serve)

if __name__ == "__main__":
    app()
