"""Programmatic dependent launch: every generated kernel opens with a grid-dependency wait, so kernels
may be launched with PDL (scheduled while the previous kernel's last wave runs) and still see every
earlier kernel's writes. On the GPU a chain of dependent kernels, eager and replayed in a CUDA graph,
must compute what it computes without PDL."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kilnx.kernels import activations as A
from kilnx.kernels import norms as N


def test_every_generated_kernel_waits_for_the_previous_grid_first():
    x = torch.zeros(4, 600, dtype=torch.bfloat16)
    src = A.silu_mul_kernel.triton_source(x, config={"ROWS": 1, "BLOCK_D": 512, "num_warps": 4})
    body = src.split("):\n", 1)[1].splitlines()
    assert body[0].strip() == "_rt.grid_dependency_sync()"


def test_pdl_is_off_without_a_gpu_under_the_interpreter_and_when_disabled():
    code = ("from kilnx.codegen import triton_rt as r; import torch; "
            "print(r.pdl_enabled(), torch.cuda.is_available())")
    for env in ({"TRITON_INTERPRET": "1"}, {"KILNX_PDL": "0"}, {}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**_base_env(), **env}).stdout.split()
        enabled, gpu = out[0] == "True", out[1] == "True"
        if env or not gpu:
            assert not enabled, env


def _base_env():
    import os
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KILNX_PDL")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_chain_of_dependent_kernels_under_pdl_equals_the_reference_eager_and_in_a_graph():
    from kilnx.codegen.triton_rt import pdl_enabled
    if torch.cuda.get_device_capability()[0] >= 9:
        assert pdl_enabled(), "sm_90+ with this Triton should launch with PDL"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4096, generator=g).cuda()
    w = torch.randn(4096, generator=g).cuda()
    gu = torch.randn(3, 8192, generator=g).cuda()

    def chain():
        h, y = x, x
        for _ in range(8):   # each kernel reads what the one before wrote (and h what two before did)
            h, y = N.add_rms_norm_kernel(y, h, w, eps=1e-6, offset=0.0)
            h, y = N.add_rms_norm_kernel(y, h, w, eps=1e-6, offset=0.0)
            y = A.silu_mul_kernel(torch.cat([y, gu[:, :4096]], dim=-1))
        return h, y

    want = [t.float().cpu() for t in _reference_chain(x.cpu(), w.cpu(), gu.cpu())]   # fp32: no rounding noise to grow
    eager = chain()
    graph = torch.cuda.CUDAGraph()
    chain()   # warm: compile outside the capture
    with torch.cuda.graph(graph):
        captured = chain()
    graph.replay()
    torch.cuda.synchronize()
    for got in (eager, captured):
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float().cpu(), b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


def _reference_chain(x, w, gu):
    h, y = x, x
    for _ in range(8):
        h, y = N.add_rms_norm_kernel(y, h, w, eps=1e-6, offset=0.0, backend="reference")
        h, y = N.add_rms_norm_kernel(y, h, w, eps=1e-6, offset=0.0, backend="reference")
        y = A.silu_mul_kernel(torch.cat([y, gu[:, :4096]], dim=-1), backend="reference")
    return h, y


import kilnx.dsl as kd  # noqa: E402


@kd.kernel(tune={"B": kd.choice(16)})
def _sync_after_a_load(x, *, B):
    kd.grid(1)
    v = kd.load(x, kd.arange(0, B))
    kd.grid_dependency_sync()
    out = kd.output((B,), kd.f32)
    kd.store(out, kd.arange(0, B), v)
    return out


def _in_a_loop(call):
    """A kernel that makes `call` (a launch-ordering statement) inside a loop."""
    @kd.kernel(tune={"B": kd.choice(16)})
    def in_a_loop(x, *, B):
        kd.grid(1)
        out = kd.output((B,), kd.f32)
        for i in kd.range(0, 2):
            call()
        kd.store(out, kd.arange(0, B), kd.load(x, kd.arange(0, B)))
        return out
    return in_a_loop


@kd.kernel(tune={"B": kd.choice(16)})
def _prefetch_then_sync(x, *, B):
    kd.grid(1)
    r = kd.arange(0, B)
    kd.prefetch(x, kd.minimum(r * 4, x.shape[0] - 1))
    kd.grid_dependency_sync()
    out = kd.output((B,), kd.f32)
    kd.store(out, r, kd.load(x, r) * 2.0)
    return out


@kd.kernel(tune={"B": kd.choice(16)})
def _prefetch_past_the_end(x, *, B):
    kd.grid(1)
    r = kd.arange(0, B)
    kd.prefetch(x, r * 4)
    out = kd.output((B,), kd.f32)
    kd.store(out, r, kd.load(x, r))
    return out


def test_a_prefetch_index_outside_the_tensor_is_refused_by_the_reference():
    """kd.prefetch has no mask: its indices must lie inside the tensor, as the reference checks."""
    with pytest.raises(kd.DSLError, match="out-of-bounds access to `x`"):
        _prefetch_past_the_end(torch.zeros(40), backend="reference")


@kd.kernel(tune={"B": kd.choice(16)})
def _trigger_twice(x, *, B):
    kd.grid(1)
    out = kd.output((B,), kd.f32)
    kd.launch_dependents()
    kd.launch_dependents()
    kd.store(out, kd.arange(0, B), kd.load(x, kd.arange(0, B)))
    return out


@pytest.mark.parametrize("kernel,message", [(_sync_after_a_load, "comes after a load of `x`"),
                                            (_in_a_loop(kd.grid_dependency_sync), "top level"),
                                            (_in_a_loop(kd.launch_dependents), "top level"),
                                            (_trigger_twice, "called twice")])
def test_a_grid_sync_after_memory_access_or_in_a_loop_is_refused(kernel, message):
    with pytest.raises(kd.DSLError, match=message):
        kernel.triton_source(torch.zeros(16))


@pytest.mark.parametrize("backend", ["reference", "numba"] + (["triton"] if __import__("os").environ.get("TRITON_INTERPRET") == "1" else []))
def test_prefetch_is_a_hint_every_backend_computes_the_same(backend):
    x = torch.arange(40, dtype=torch.float32)
    torch.testing.assert_close(_prefetch_then_sync(x, backend=backend), x[:16] * 2)
    src = _prefetch_then_sync.triton_source(x)
    body = src.split("):\n", 1)[1]
    assert body.index("_rt.prefetch_l2(") < body.index("_rt.grid_dependency_sync()") < body.index("tl.load(")


def test_with_pdl_on_the_sm90_code_waits_then_triggers():
    """Compiled for sm_90 here (no GPU): with PDL forced on, every kernel's PTX holds the wait and then
    the trigger."""
    code = """
import sys, torch, triton.language as tl
from kilnx.codegen import triton_rt
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import activations as A
triton_rt.PDL = tl.constexpr(True)
ptx = compile_for_target(A.silu_mul_kernel, (torch.zeros(4, 1024).bfloat16(),), {}).asm["ptx"]
w, t = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
print(0 <= w < t)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_base_env())
    assert r.stdout.strip() == "True", (r.stdout, r.stderr[-3000:])


@kd.kernel(tune={"B": kd.choice(16)})
def _write_then_read_back(x, buf, *, B):
    """Each program writes its row of buf reversed, then (after the barrier) reads it back in order."""
    row = kd.grid(x.shape[0])
    r = kd.arange(0, B)
    kd.store(buf, row, B - 1 - r, kd.load(x, row, r))
    kd.barrier()
    out = kd.output((x.shape[0], B), kd.f32)
    kd.store(out, row, r, kd.load(buf, row, r) * 2.0)
    return out


@pytest.mark.parametrize("backend", ["reference", "numba"] + (["triton"] if __import__("os").environ.get("TRITON_INTERPRET") == "1" else []))
def test_a_program_reads_back_what_it_wrote_after_a_barrier(backend):
    x = torch.arange(48, dtype=torch.float32).reshape(3, 16)
    got = _write_then_read_back(x, torch.zeros(3, 16), backend=backend)
    torch.testing.assert_close(got, x.flip(1) * 2)
    src = _write_then_read_back.triton_source(x, torch.zeros(3, 16))
    assert src.index("tl.store(") < src.index("tl.debug_barrier()") < src.rindex("tl.load(")
