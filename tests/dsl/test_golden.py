"""Golden files of generated Triton source: a failing diff shows exactly what codegen changed.

The source is the GPU source (`kernel.triton_source(...)`, not the interpreter variant) for a fixed
config. Regenerate after an intended change with

    KILNX_UPDATE_GOLDEN=1 TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/dsl/test_golden.py

and review the diff of tests/dsl/golden/. Generation is text only: it must not import Triton, so the
files hold for every Triton version (the GPU image and CI run different ones).
"""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kilnx.kernels import activations as A
from kilnx.kernels import norms as N
from kilnx.kernels import qmatmul as Q
from kilnx.kernels import ssm as S

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE = os.environ.get("KILNX_UPDATE_GOLDEN") == "1"

# name -> (kernel, input maker, config, runtime scalars). Shapes only decide dtypes and ranks here.
CASES = {
    "add_rms_norm_persistent": (
        N.add_rms_norm_kernel,
        lambda: (torch.zeros(4, 300, dtype=torch.bfloat16), torch.zeros(4, 300, dtype=torch.bfloat16),
                 torch.zeros(300, dtype=torch.bfloat16)),
        {"ROWS": 2, "BLOCK_D": 512, "num_warps": 4}, dict(eps=1e-6, offset=0.0)),
    "add_rms_norm_looped": (
        N.add_rms_norm_kernel,
        lambda: (torch.zeros(4, 300, dtype=torch.bfloat16), torch.zeros(4, 300, dtype=torch.bfloat16),
                 torch.zeros(300, dtype=torch.bfloat16)),
        {"ROWS": 1, "BLOCK_D": 128, "num_warps": 4}, dict(eps=1e-6, offset=0.0)),
    "silu_mul": (
        A.silu_mul_kernel,
        lambda: (torch.zeros(4, 2 * 300, dtype=torch.bfloat16),),
        {"ROWS": 1, "BLOCK_D": 512, "num_warps": 4}, {}),
    # the dense GEMM reading both operands as kd.load_tile boxes (TMA descriptors made once, before the loop)
    "mm_boxes": (
        Q.mm,
        lambda: (torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(512, 128, dtype=torch.bfloat16)),
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "TMA": True}, {}),
    # the same GEMM persistent: one program per SM walks the tiles, its tile and K loops flattened into one
    "mm_persistent": (
        Q.mm,
        lambda: (torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(512, 128, dtype=torch.bfloat16)),
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "TMA": True,
         "PERSISTENT": True}, {}),
    # Mamba-2's scan: a program's (BLOCK_P, N) state carried through a runtime loop over its sequence's tokens,
    # then stored unless the sequence is parked
    "ssm_scan": (
        S.ssm_scan_kernel,
        lambda: (torch.zeros(8, 4, 16, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16),
                 torch.zeros(8, 2, 32, dtype=torch.bfloat16), torch.zeros(8, 2, 32, dtype=torch.bfloat16),
                 torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(2, 4, 16, 32),
                 torch.zeros(8, dtype=torch.long)),
        {"BLOCK_P": 16, "num_warps": 4}, dict(limit=99, dt_min=0.0, dt_max=1e30, BLOCK_N=32)),
}
# pointers of another dtype than bf16 in a case's inputs (the compile check's signature)
POINTER_DTYPES = {"ssm_scan": {"A_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "D_ptr": "*fp32", "state_ptr": "*fp32",
                               "positions_ptr": "*i64"}}
FLOAT_SCALARS = ("eps", "offset", "dt_min", "dt_max")


def source(name: str) -> str:
    kernel, make, cfg, scalars = CASES[name]
    return kernel.triton_source(*make(), config=cfg, **scalars)


@pytest.mark.parametrize("name", list(CASES))
def test_generated_triton_matches_golden(name):
    path = GOLDEN_DIR / f"{name}.py.expected"
    got = source(name)
    if UPDATE:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(got)
        pytest.skip(f"regenerated {path.name}")
    assert path.exists(), f"{path} is missing: run with KILNX_UPDATE_GOLDEN=1 to create it"
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"{path.name} (golden)", "generated"))
        pytest.fail(f"generated Triton source changed; if intended, regenerate with KILNX_UPDATE_GOLDEN=1\n{diff}")


@pytest.mark.parametrize("name", list(CASES))
def test_golden_source_is_a_jit_kernel_of_plain_tl_calls(name):
    text = (GOLDEN_DIR / f"{name}.py.expected").read_text()
    tree = ast.parse(text)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(fns) == 1 and any(ast.unparse(d) == "triton.jit" for d in fns[0].decorator_list)
    imports = {ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert imports == {"import triton", "import triton.language as tl",
                       "from kilnx.codegen import triton_rt as _rt"}
    first = fns[0].body[0]
    assert ast.unparse(first) == "_rt.grid_dependency_sync()"   # before any memory access (PDL)
    assert "interpret" not in text.lower()   # the GPU variant, not the interpreter's


def test_looped_and_persistent_goldens_differ_in_structure():
    persistent = (GOLDEN_DIR / "add_rms_norm_persistent.py.expected").read_text()
    looped = (GOLDEN_DIR / "add_rms_norm_looped.py.expected").read_text()
    assert "for " not in persistent and persistent.count("tl.sum(") == 1
    assert looped.count("for ") == 2 and looped.count("tl.sum(") == 1


def test_generation_does_not_import_triton():
    """Blocking the triton package must not change a byte: the text cannot depend on its version."""
    code = f"""
import sys
sys.modules["triton"] = None            # any `import triton` now raises ImportError
sys.modules["triton.language"] = None
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_golden as g
for name in g.CASES:
    assert g.source(name) == (g.GOLDEN_DIR / f"{{name}}.py.expected").read_text(), name
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "KILNX_UPDATE_GOLDEN"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the golden source in the interpreter")
def test_golden_persistent_source_runs_and_matches_the_reference():
    """The golden text is a working kernel: load it as the Triton module and launch it."""
    from kilnx.codegen import launch as L
    kernel, _, cfg, scalars = CASES["add_rms_norm_persistent"]
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(3, 300, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(300, generator=g).bfloat16()
    ir = kernel.trace(cfg, (x, res, w), scalars)
    text = (GOLDEN_DIR / "add_rms_norm_persistent.py.expected").read_text()
    fn = getattr(L.load_module(text, "golden"), kernel.name)
    h, y = L.Launch(ir, "triton", text, fn)({"x": x, "res": res, "w": w}, scalars)
    h_ref, y_ref = kernel(x, res, w, backend="reference", config=cfg, **scalars)
    # the interpreter truncates fp32->bf16: one ulp
    torch.testing.assert_close(h, h_ref, rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(y, y_ref, rtol=2 ** -7, atol=1e-6)



def _compile_for_gpu(name: str):
    """Compile a golden source for an sm_90 target on this machine (no GPU needed), with every int
    argument set to 1: Triton specializes ints equal to 1 into constexprs (a one-column tensor, a unit
    stride, a single row), and generated code must accept them. Run without TRITON_INTERPRET. Except the
    row strides of tensors read as kd.load_tile boxes: TMA refuses a stride of one element (the launcher
    raises before such a call), so those stay runtime ints."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    from kilnx.codegen import launch as L
    kernel = CASES[name][0]
    fn = getattr(L.load_module((GOLDEN_DIR / f"{name}.py.expected").read_text(), f"{name}_gpu_check"), kernel.name)
    names = list(inspect.signature(fn.fn).parameters)
    text = (GOLDEN_DIR / f"{name}.py.expected").read_text()
    box_strides = {f"{t}_stride{d}" for t, strides in re.findall(r"make_tensor_descriptor\((\w+)_ptr, .*?strides=\[(.*?)\]", text)
                   for d in range(strides.count(","))}
    sig, constexprs = {}, {}
    for i, n in enumerate(names):
        if n.endswith("_ptr"):
            sig[n] = POINTER_DTYPES.get(name, {}).get(n, "*bf16")
        elif n in FLOAT_SCALARS:
            sig[n] = "fp32"
        elif n in box_strides:
            sig[n] = "i32"
        else:
            sig[n], constexprs[(i,)] = "constexpr", 1
    src = triton.compiler.ASTSource(fn, signature=sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "ttir" in compiled.asm


def test_golden_sources_compile_for_the_gpu_with_unit_int_arguments():
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_golden as g
for name in g.CASES:
    g._compile_for_gpu(name)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("KILNX_UPDATE_GOLDEN", "TRITON_INTERPRET")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
