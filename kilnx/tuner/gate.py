"""Correctness gate: a config is only timed after its output matches the reference.

Configs that are fast because they are wrong (a skipped tail tile, a race, an unwritten output) are
the classic way an autotuner fools itself. So every candidate runs on fresh random inputs and each
output is compared with `kernel.reference(...)` within tolerance (with a kernel's declared `finish`, the finished
outputs with its finished reference: kd.kernel's tuning()). NaN never passes, even where the
reference has one. To catch outputs the kernel never writes, the allocator is poisoned before each
call (blocks of the output sizes are filled with NaN, then a huge value, and freed, so a fresh
`empty` tends to get them back), and the candidate must pass under both poisons, on two input draws
that are not the inputs it is timed on.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class GateFailure(Exception):
    """The candidate's output does not match the reference; the message says where and by how much."""


# (rtol, atol) by output dtype: loose enough for fp32 accumulation order and tf32 dots, tight enough
# that a missing tile or a wrong element (typically O(1) off) is caught.
_DEFAULT_TOLERANCE = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


def as_tuple(out: Any) -> tuple:
    if isinstance(out, (tuple, list)):
        return tuple(out)
    return (out,)


def tolerance_for(kernel: Any, args: Sequence[Any], out: torch.Tensor) -> tuple[float, float]:
    tol = getattr(kernel, "tolerance", None)
    if callable(tol):
        got = tol(args)
        if got is not None:
            return float(got[0]), float(got[1])
    return _DEFAULT_TOLERANCE.get(out.dtype, (0.0, 0.0))  # ints and bools: exact


def compare(kernel: Any, args: Sequence[Any], outs: Sequence[Any], refs: Sequence[Any]) -> float:
    """Max abs error over all outputs; raises GateFailure on any mismatch."""
    if len(outs) != len(refs):
        raise GateFailure(f"kernel returned {len(outs)} outputs, reference has {len(refs)}")
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outs, refs)):
        if not isinstance(out, torch.Tensor):
            raise GateFailure(f"output {i} is {type(out).__name__}, not a tensor")
        ref = torch.as_tensor(ref)
        if tuple(out.shape) != tuple(ref.shape):
            raise GateFailure(f"output {i} has shape {tuple(out.shape)}, reference {tuple(ref.shape)}")
        rtol, atol = tolerance_for(kernel, args, out)
        o = out.detach().to("cpu", torch.float64)
        r = ref.detach().to("cpu", torch.float64)
        nan = torch.isnan(o)
        if nan.any():
            raise GateFailure(f"output {i} has {int(nan.sum())} NaN element(s) (unwritten or invalid)")
        bad_inf = torch.isinf(o) & (o != r)
        err = (o - r).abs()
        err = torch.where(torch.isinf(o) & (o == r), torch.zeros_like(err), err)
        over = (err > atol + rtol * r.abs()) | bad_inf | torch.isnan(err)
        if over.any():
            idx = int(over.flatten().nonzero()[0])
            raise GateFailure(
                f"output {i}: {int(over.sum())}/{over.numel()} elements out of tolerance "
                f"(rtol={rtol}, atol={atol}); first at flat index {idx}: got {o.flatten()[idx].item():.6g}, "
                f"want {r.flatten()[idx].item():.6g}")
        if err.numel():
            worst = max(worst, float(err.max()))
    return worst


def _poison_allocator(refs: Sequence[Any], device: str, value: float) -> None:
    """Fill and free blocks of the output sizes so that fresh outputs start out as `value`."""
    blocks = []
    for ref in refs:
        if isinstance(ref, torch.Tensor):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                blocks.append(torch.full(tuple(ref.shape), value, dtype=dtype, device=device))
    del blocks  # freed blocks go back to the caching allocator (GPU) or malloc (CPU) holding `value`


def trial_call(kernel: Any, config: dict, args: Sequence[Any]) -> Callable[..., Any]:
    """The call a trial checks and times: the kernel's tuning_call where it has one (kd.kernel: the kernel and its
    declared finish), else its compiled config (routes, injected kernels)."""
    call = getattr(kernel, "tuning_call", None)
    return call(config, *args) if call is not None else kernel.compile(config, *args)


def reference_of(kernel: Any, args: Sequence[Any]):
    """The outputs a trial must match: the kernel's tuning_reference where it has one, else its reference."""
    ref = getattr(kernel, "tuning_reference", None)
    return ref(*args) if ref is not None else kernel.reference(*args)


def _clone(args: Sequence[Any]) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


class GateCases:
    """Input draws and their reference outputs for one problem, computed once and reused by every
    trial: the numpy reference of a large problem can cost more than the trial itself. Each use hands
    out clones of the inputs, so a kernel that writes its inputs cannot spoil the next trial's check."""

    def __init__(self, kernel: Any, make_args: Callable[[int], tuple], draws: int = 2):
        self.cases = []
        for draw in range(draws):
            args = tuple(make_args(draw))
            self.cases.append((args, as_tuple(reference_of(kernel, _clone(args)))))

    def __iter__(self):
        for args, refs in self.cases:
            yield _clone(args), refs


def check(kernel: Any, fn: Callable[..., Any], cases, device: str) -> float:
    """Run `fn` on each (args, reference outputs) case, under a different poison each time; the max
    abs error if every output matches, else raise GateFailure."""
    worst = 0.0
    poisons = (float("nan"), 3.0e4)
    for i, (args, refs) in enumerate(cases):
        _poison_allocator(refs, device, poisons[i % len(poisons)])
        outs = fn(*args)
        values = getattr(fn, "finished_values", None)       # a tuning_call's finish in another form (kd.kernel)
        outs = as_tuple(values(outs, *args) if values is not None else outs)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        worst = max(worst, compare(kernel, args, outs, refs))
    return worst
