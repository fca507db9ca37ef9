"""The kernel language. `import kilnx.dsl as kd`.

`@kd.fusion` for row-wise elementwise + reduction kernels; `@kd.kernel` for tile-level kernels.
"""

from kilnx.dsl.ir import DSLError
from kilnx.dsl.lang import (abs, arange, argmax, assign, atomic_add, bf16, bitcast, broadcast_to, cdiv,
                            constexpr,
                            dot, erf, exp, f8e4, f16, f32, f64, full, gelu_tanh, grid, i8, i16, i32, i64, join, load,
                            log, max, maximum, mean, min, minimum, output, permute, program_id, range, reshape,
                            rsqrt, sigmoid, silu, softplus, sqrt, static_range, store, sum, tanh, trans,
                            u8, u32, var, where, zeros)
from kilnx.dsl.lang import bf2_fma, bf2_half, byte_perm, h2_fma, h2_pack, h2_sum, nibbles
from kilnx.dsl.lang import cos, sin
from kilnx.dsl.lang import barrier, grid_dependency_sync, launch_dependents, load_tile, prefetch
from kilnx.dsl.tiles import halves, pick
from kilnx.dsl.fusion import fusion, split
from kilnx.dsl.kernel import kernel
from kilnx.dsl.tunables import Space, SpaceError, boolean, choice, int_range, pow2

__all__ = [n for n in dir() if not n.startswith("_")]
