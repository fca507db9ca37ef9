"""Triton helpers that generated kernels call as `_rt.<name>` for ops with no `tl.*` spelling.

The packed-half2 ops (kilnx/dsl/opdefs.py) are one PTX instruction each on the GPU. Triton's
interpreter cannot run inline PTX, so under TRITON_INTERPRET=1 each helper computes the same bits
with Triton ops instead (fp16 halves widened to fp64, where fp16 products and sums are exact, then
rounded once). The choice is a constexpr: the compiled GPU kernel contains only the PTX.

`grid_dependency_sync` opens every generated kernel: see `pdl_enabled`.
"""

import functools
import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

try:   # Triton 3.3 and later spell grid dependency control here; older ones cannot launch with PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - present in the Triton versions kilnx runs on
    gdc_wait = gdc_launch_dependents = None


@functools.lru_cache(maxsize=None)
def pdl_enabled() -> bool:
    """Whether kernels launch with programmatic dependent launch (PDL): on sm_90 and later, with a Triton
    that has the `launch_pdl` launch option, unless KILNX_PDL=0.

    A decode step is a chain of ~300 short dependent kernels, and without PDL each waits for the
    previous one to finish before its blocks are even scheduled (~1 us a boundary on an H200). With
    PDL the next kernel's blocks are scheduled while the previous one's last wave runs, and wait at
    their first statement (`griddepcontrol.wait`) until it has finished and its writes are visible.
    Because every kernel waits before it touches memory and before it can finish, a kernel's
    completion still implies that of every kernel before it: dependences two launches apart hold."""
    if INTERPRET or gdc_wait is None or os.environ.get("KILNX_PDL", "1") == "0":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = tl.constexpr(pdl_enabled())
# The wait comes before the trigger: letting the next kernel be scheduled before this one waits (tried as
# KILNX_PDL_TRIGGER=early) was slower on the H200: llama-3.1-8b decode 398.5 / 383.3 tok/s against 418.0 /
# 417.1, llama-3.2-1b 1120 / 1109 against 1315 / 1368 (bench/results/2026-12-03_h200_e2e_s7_pdl_trigger_*.csv):
# blocks that launched early sit on SM slots waiting while the kernel before them still has blocks to place.


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the lines at `ptrs` in L2 (kd.prefetch); nothing under the interpreter."""
    if INTERPRET:
        pass
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def grid_dependency_sync():
    """Wait for the previous kernel in the stream (a no-op unless launched with PDL), then let the next
    one be scheduled. Generated kernels call this before any other statement."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def grid_dependency_wait():
    """grid_dependency_sync without the trigger, for kernels that place it (launch_dependents)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents():
    """Let the next kernel in the stream be scheduled (kd.launch_dependents; a no-op unless launched with PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _half(a, shift: tl.constexpr, dtype: tl.constexpr = tl.float16):
    """The 16-bit float (fp16 or bf16) in the half of each u32 at `shift`, widened to float64."""
    return ((a >> shift) & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True).to(tl.float64)


@triton.jit
def _bits(v):
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def h2_pack(lo, hi):
    """Two floats rounded to fp16 (nearest even) in one u32, `lo` in the low half."""
    return _bits(lo.to(tl.float32)) | (_bits(hi.to(tl.float32)) << 16)


@triton.jit
def h2_fma(a, b, c):
    """a * b + c on both fp16 halves, rounded once (fma.rn.f16x2)."""
    if INTERPRET:
        lo = _half(a, 0) * _half(b, 0) + _half(c, 0)
        hi = _half(a, 16) * _half(b, 16) + _half(c, 16)
        return _bits(lo) | (_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def h2_sum(a):
    """The two fp16 halves widened to fp32 and added."""
    if INTERPRET:
        return _half(a, 0).to(tl.float32) + _half(a, 16).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; .reg .f32 x, y; mov.b32 {l, h}, $1; cvt.f32.f16 x, l; cvt.f32.f16 y, h; "
            "add.rn.f32 $0, x, y; }", "=f,r", [a], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _bf16_bits(v):
    """float64 -> bf16 bits, nearest even, one rounding (the interpreter's fma.rn.bf16x2)."""
    b = v.to(tl.uint64, bitcast=True)
    b = (b + ((1 << 44) - 1) + ((b >> 45) & 1)) & 0xFFFFE00000000000
    return (b.to(tl.float64, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True) >> 16) & 0xFFFF


@triton.jit
def bf2_fma(a, b, c):
    """a * b + c on both bf16 halves, rounded once (fma.rn.bf16x2)."""
    if INTERPRET:
        lo = _half(a, 0, tl.bfloat16) * _half(b, 0, tl.bfloat16) + _half(c, 0, tl.bfloat16)
        hi = _half(a, 16, tl.bfloat16) * _half(b, 16, tl.bfloat16) + _half(c, 16, tl.bfloat16)
        return _bf16_bits(lo) | (_bf16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def bf2_half(x, h):
    """The bf16 in half h of each pair. Both halves by constant shifts, then a select on h: h is an arange
    along a register axis, so the select folds away (a shift by h * 16 stayed a per-element shift)."""
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(h == 0, lo, hi)


@triton.jit
def byte_perm(a, b, sel):
    """prmt.b32 in its default mode (kilnx/dsl/half2.py: byte_perm)."""
    if INTERPRET:
        both = a.to(tl.uint64) | (b.to(tl.uint64) << 32)
        out = tl.zeros(a.shape, tl.uint64) + (sel * 0).to(tl.uint64)
        for i in tl.static_range(4):
            nib = (sel.to(tl.uint64) >> (4 * i)) & 15
            byte = (both >> ((nib & 7) * 8)) & 0xFF
            byte = tl.where((nib & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
            out = out | (byte.to(tl.uint64) << (8 * i))
        return out.to(tl.uint32)
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.uint32, is_pure=True, pack=1)


# kd.nibbles (kilnx/dsl/half2.py): four bytes (one register, pack=4) at a time. Output element j of `lo` / `hi`
# is byte j's low / high code; the byte permutes bring bytes (0, 1) and (2, 3) into the halves of a word, one
# LOP3 each masks a code pair into bf16 128.0's mantissa (exact 128 + q).
NIBBLE_ASM = tl.constexpr("""{ .reg .b32 t, u;
    prmt.b32 t, $4, 0, 0x5150; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea;
    shr.u32 u, t, 4; lop3.b32 $2, u, 0x000F000F, 0x43004300, 0xea;
    prmt.b32 t, $4, 0, 0x5352; lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xea;
    shr.u32 u, t, 4; lop3.b32 $3, u, 0x000F000F, 0x43004300, 0xea; }""")
# ... and q * s + b: 128 + q minus 128 (exact), then one bf16x2 FMA with the bytes' scale and bias pairs
NIBBLE_DEQUANT_ASM = tl.constexpr("""{ .reg .b32 t, u, v, q, one, m128;
    mov.b32 one, 0x3F803F80; mov.b32 m128, 0xC300C300;
    prmt.b32 t, $4, 0, 0x5150;
    lop3.b32 v, t, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 q, v, one, m128; fma.rn.bf16x2 $0, q, $5, $7;
    shr.u32 u, t, 4;
    lop3.b32 v, u, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 q, v, one, m128; fma.rn.bf16x2 $2, q, $5, $7;
    prmt.b32 t, $4, 0, 0x5352;
    lop3.b32 v, t, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 q, v, one, m128; fma.rn.bf16x2 $1, q, $6, $8;
    shr.u32 u, t, 4;
    lop3.b32 v, u, 0x000F000F, 0x43004300, 0xea; fma.rn.bf16x2 q, v, one, m128; fma.rn.bf16x2 $3, q, $6, $8; }""")


@triton.jit
def nibbles(x):
    """u8 -> (..., 2) bf16 128 + code (low code at 0)."""
    if INTERPRET:
        lo = ((x & 0xF).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        hi = ((x >> 4).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    else:
        lo, hi = tl.inline_asm_elementwise(NIBBLE_ASM, "=r,=r,=r,=r,r", [x], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    return tl.join(lo, hi)


@triton.jit
def nibbles_dequant(x, s, b):
    """u8 -> (..., 2) bf16 code * s + b, one rounding."""
    if INTERPRET:   # exact in float64, rounded once (the interpreter's own bf16 conversion truncates)
        sf, bf = s.to(tl.float64), b.to(tl.float64)
        lo = _bf16_bits((x & 0xF).to(tl.float64) * sf + bf).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = _bf16_bits((x >> 4).to(tl.float64) * sf + bf).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        lo, hi = tl.inline_asm_elementwise(NIBBLE_DEQUANT_ASM, "=r,=r,=r,=r,r,r,r,r,r", [x, s, b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.join(lo, hi)


# fp8 e4m3fn conversions as the interpreter runs them (triton_gen emits these only under TRITON_INTERPRET=1; compiled
# kernels convert with the hardware's cvt): its own fp32 -> fp8 cast loses the carry of a mantissa that rounds up
# into the next binade (31.4 -> 16) and flushes subnormals, so the bits are built here as reference.round_to does.
@triton.jit
def to_f8e4(x):
    """fp32 -> e4m3fn: to nearest even, saturating at +-448, NaN kept."""
    b = x.to(tl.float32).to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    mag = b & 0x7FFFFFFF
    # below 2^-6 (subnormal codes): adding 2^14 makes the fp32 ulp the fp8 quantum 2^-9, so the add rounds
    low = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    odd = (mag >> 20) & 1
    high = ((mag - (120 << 23) + 0x7FFFF + odd) >> 20) & 0xFF
    code = tl.where(mag < (121 << 23), low, high)
    code = tl.where(mag >= (543 << 21), 0x7E, code)          # from 464, halfway past 448, up
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return (code | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def f8e4_to_f32(x):
    """e4m3fn -> fp32, exactly (subnormals m * 2^-9; 0x7F is NaN)."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    val = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    val = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, val)
    return (val | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
