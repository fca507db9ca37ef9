"""Compile a kernel's GPU source for a target without a GPU (Triton's ahead-of-time path).

The interpreter accepts more than the compiler does (dot shapes, scalar/tile mixes, constexpr ints),
so tests compile the real GPU source of library kernels for sm_90 on the CPU machine.
"""

from __future__ import annotations

import inspect

TL_PTR = {"f8e4": "fp8e4nv", "f32": "fp32", "bf16": "bf16", "f16": "fp16", "i32": "i32", "u32": "i32", "i8": "i8",
          "u8": "u8", "i64": "i64", "i16": "i16"}


def compile_for_target(kernel, args: tuple, config: dict, *, arch: int = 90, unit_ints: bool = False,
                       kw: dict | None = None, aligned: bool = False):
    """Trace `kernel` on `args` (CPU tensors fine) with `config` and compile its Triton source for
    cuda:`arch`. With `unit_ints` every int argument is 1, which Triton turns into a constexpr. With
    `aligned`, pointers and ints are declared multiples of 16, as the JIT finds them on real shapes
    (what lets it vectorize loads): the code then matches what runs on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    import torch

    from kilnx.codegen.launch import Launch, load_module
    from kilnx.codegen.triton_gen import generate
    from kilnx.dsl.ir import TensorParam

    kw = dict(kw or {})
    cfg = kernel.space.validate(config)
    ir = kernel.trace(cfg, args, kw)
    fn = getattr(load_module(generate(ir, header=f"{cfg}"), f"{kernel.name}_aot"), kernel.name)
    # the argument values a launch on these tensors would pass (outputs allocated, shapes evaluated)
    tensors = {p.name: a for p, a in zip([p for p in ir.params if isinstance(p, TensorParam)],
                                         [a for a in args if isinstance(a, torch.Tensor)])}
    scalars = {k: v for k, v in kw.items() if not kernel._is_constexpr(k)}
    launch = Launch(ir, "reference", None, None)
    outs = {p.name: torch.empty([launch.host_eval(d, tensors, scalars) for d in dims], dtype=torch.float32)
            for p, dims, _ in ir.outputs}
    values = launch._flat_args({**tensors, **outs}, scalars, lambda t: t)
    dtypes = {p.name: p.dtype for p in ir.params + [o[0] for o in ir.outputs]}
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(inspect.signature(fn.fn).parameters, values)):
        if name.endswith("_ptr"):
            sig[name] = "*" + TL_PTR[dtypes[name[:-4]]]
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif unit_ints or (aligned and value == 1):
            sig[name], constexprs[(i,)] = "constexpr", 1
        else:
            sig[name] = "i32"
            if aligned and isinstance(value, int) and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    src = triton.compiler.ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
