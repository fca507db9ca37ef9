"""Compile a kernel's GPU source for a target without a GPU (Triton's ahead-of-time path).

The interpreter accepts more than the compiler does (dot shapes, scalar/tile mixes, constexpr ints),
so tests compile the real GPU source of library kernels for sm_90 on the CPU machine.
"""

from __future__ import annotations

import inspect

TL_PTR = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "i32": "i32", "u32": "i32", "i8": "i8",
          "u8": "u8", "i64": "i64", "i16": "i16"}


def compile_for_target(kernel, args: tuple, config: dict, *, arch: int = 90, unit_ints: bool = False,
                       kw: dict | None = None):
    """Trace `kernel` on `args` (CPU tensors fine) with `config` and compile its Triton source for
    cuda:`arch`. With `unit_ints` every int argument is 1, which Triton turns into a constexpr."""
    import triton
    from triton.backends.compiler import GPUTarget

    from kilnx.codegen.launch import load_module
    from kilnx.codegen.triton_gen import generate

    kw = dict(kw or {})
    cfg = kernel.space.validate(config)
    ir = kernel.trace(cfg, args, kw)
    fn = getattr(load_module(generate(ir, header=f"{cfg}"), f"{kernel.name}_aot"), kernel.name)
    dtypes = {p.name: p.dtype for p in ir.params + [o[0] for o in ir.outputs]}
    sig, constexprs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name.endswith("_ptr"):
            sig[name] = "*" + TL_PTR[dtypes[name[:-4]]]
        elif unit_ints:
            sig[name], constexprs[(i,)] = "constexpr", 1
        else:
            sig[name] = "i32"
    options = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}
    src = triton.compiler.ASTSource(fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
