"""Kernel-authoring mistakes fail early, at definition or trace time, and point at the author's line.

Lines that must be named in an error end with a `# <tag>` comment; `line_of(tag)` finds them, so the
tests do not depend on line numbers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import kilnx.dsl as kd
from kilnx.dsl import DSLError, SpaceError

SRC = Path(__file__).read_text().splitlines()
HERE = os.path.basename(__file__)


def line_of(tag: str) -> int:
    hits = [i + 1 for i, line in enumerate(SRC) if line.rstrip().endswith(f"# <{tag}>")]
    assert len(hits) == 1, f"tag {tag} must mark exactly one line"
    return hits[0]


def assert_points_at(err: BaseException, tag: str):
    where = f"{HERE}:{line_of(tag)}:"
    assert where in str(err), f"error does not name {where}:\n{err}"


def assert_raised_at(excinfo, tag: str):
    """For errors that carry no location in their message: the traceback passes the author's line."""
    frames = [(os.path.basename(str(e.path)), e.lineno + 1) for e in excinfo.traceback]
    assert (HERE, line_of(tag)) in frames, frames


X = torch.randn(8, 16)


def trace(kernel, *args, **kw):
    return kernel.triton_source(*args, config={}, **kw)


# ---- on traced values ---------------------------------------------------------------------------------
@kd.kernel(tune={"B": kd.choice(16)})
def indexes_a_tile(x, *, B):
    pid = kd.grid(1)
    v = kd.load(x, pid, kd.arange(0, B))
    first = v[0]  # <index>
    out = kd.output((1,), kd.f32)
    kd.store(out, 0, first)
    return out


def test_integer_indexing_of_a_tile():
    with pytest.raises(DSLError, match="tile indexing takes only `:` and `None`") as e:
        trace(indexes_a_tile, X)
    assert_points_at(e.value, "index")


@kd.kernel(tune={"B": kd.choice(16)})
def uses_matmul_operator(x, *, B):
    pid = kd.grid(1)
    r = kd.arange(0, B)
    t = kd.load(x, r[:, None], r[None, :])
    out = kd.output((B, B), kd.f32)
    kd.store(out, r[:, None], r[None, :], t @ t)  # <matmul>
    return out


def test_matmul_operator_points_to_kd_dot():
    with pytest.raises(DSLError, match="kd.dot") as e:
        trace(uses_matmul_operator, torch.randn(16, 16))
    assert_points_at(e.value, "matmul")


@kd.kernel(tune={"B": kd.choice(16)})
def calls_math_on_a_tile(x, *, B):
    pid = kd.grid(1)
    v = kd.load(x, pid, kd.arange(0, B))
    out = kd.output((B,), kd.f32)
    kd.store(out, kd.arange(0, B), math.exp(v))  # <math>
    return out


def test_python_math_on_a_traced_value():
    with pytest.raises(DSLError, match="traced value") as e:
        trace(calls_math_on_a_tile, X)
    assert_points_at(e.value, "math")


@kd.kernel(tune={"B": kd.choice(16)})
def adds_a_string(x, *, B):
    pid = kd.grid(1)
    v = kd.load(x, pid, kd.arange(0, B))
    out = kd.output((B,), kd.f32)
    kd.store(out, kd.arange(0, B), v + "1")  # <str>
    return out


def test_unsupported_operand():
    with pytest.raises(DSLError, match="cannot use str") as e:
        trace(adds_a_string, X)
    assert_points_at(e.value, "str")


# ---- shapes -----------------------------------------------------------------------------------------
@kd.kernel(tune={"B": kd.choice(16)})
def mismatched_shapes(x, *, B):
    pid = kd.grid(1)
    a = kd.load(x, pid, kd.arange(0, B))
    b = kd.arange(0, 2 * B).to(kd.f32)
    out = kd.output((B,), kd.f32)
    kd.store(out, kd.arange(0, B), a + b)  # <bcast>
    return out


def test_shape_mismatch_is_a_broadcast_error():
    with pytest.raises(DSLError, match=r"shapes \[16\] and \[32\] do not broadcast") as e:
        trace(mismatched_shapes, X)
    assert_points_at(e.value, "bcast")


@kd.kernel(tune={"B": kd.choice(16)})
def reshapes_to_the_wrong_size(x, *, B):
    pid = kd.grid(1)
    a = kd.load(x, pid, kd.arange(0, B))
    out = kd.output((B,), kd.f32)
    kd.store(out, kd.arange(0, B), kd.reshape(a, (3, 5)))  # <reshape>
    return out


def test_reshape_to_a_different_size():
    with pytest.raises(DSLError, match=r"cannot reshape \[16\] to \[3, 5\]") as e:
        trace(reshapes_to_the_wrong_size, X)
    assert_points_at(e.value, "reshape")


@kd.kernel(tune={"B": kd.choice(16)})
def arange_not_pow2(x, *, B):
    pid = kd.grid(1)
    cols = kd.arange(0, B - 4)  # <arange>
    out = kd.output((B,), kd.f32)
    kd.store(out, cols, kd.load(x, pid, cols))
    return out


def test_arange_length_must_be_a_power_of_two():
    with pytest.raises(DSLError, match=r"kd.arange\(0, 12\): the length must be a power of two") as e:
        trace(arange_not_pow2, X)
    assert_points_at(e.value, "arange")


# ---- control flow -----------------------------------------------------------------------------------
@kd.kernel(tune={"B": kd.choice(16)})
def python_if_on_a_value(x, *, B):
    pid = kd.grid(1)
    v = kd.load(x, pid, kd.arange(0, B))
    s = kd.sum(v)
    out = kd.output((1,), kd.f32)
    if s > 0:  # <if>
        s = -s
    kd.store(out, 0, s)
    return out


def test_python_if_on_a_traced_value():
    with pytest.raises(DSLError, match="kd.where") as e:
        trace(python_if_on_a_value, X)
    assert_points_at(e.value, "if")


@kd.fusion
def fusion_with_python_if(x):
    h = x.f32()
    return h if kd.max(h, axis=-1, keepdims=True) > 0 else -h  # <fusion-if>


def test_python_if_in_a_fusion():
    with pytest.raises(DSLError, match="kd.where") as e:
        fusion_with_python_if.triton_source(X)
    assert_points_at(e.value, "fusion-if")


@kd.kernel(tune={"B": kd.choice(16)})
def uses_loop_value_outside(x, *, B):
    M, K = x.shape
    pid = kd.grid(M)
    for k0 in kd.range(0, K, B):
        last = kd.load(x, pid, k0 + kd.arange(0, B))
    out = kd.output((M, B), kd.f32)
    kd.store(out, pid, kd.arange(0, B), last * 2.0)  # <escape>
    return out


def test_value_from_inside_a_loop_used_after_it():
    with pytest.raises(DSLError, match="computed inside a loop is used outside it") as e:
        trace(uses_loop_value_outside, X)
    assert_points_at(e.value, "escape")


@kd.kernel(tune={"B": kd.choice(16)})
def python_range_over_a_runtime_size(x, *, B):
    M, K = x.shape
    pid = kd.grid(M)
    out = kd.output((M, B), kd.f32)
    for k0 in range(0, K, B):  # <pyrange>
        kd.store(out, pid, kd.arange(0, B), kd.load(x, pid, k0 + kd.arange(0, B)))
    return out


def test_python_range_over_a_runtime_size_points_to_kd_range():
    with pytest.raises(DSLError, match="kd.range") as e:
        trace(python_range_over_a_runtime_size, X)
    assert_points_at(e.value, "pyrange")


# ---- tunables -----------------------------------------------------------------------------------------
def test_empty_choice_is_rejected_where_it_is_written():
    with pytest.raises(SpaceError, match="at least one value") as e:
        kd.choice()  # <choice>
    assert_raised_at(e, "choice")


@pytest.mark.parametrize("lo,hi", [(3, 8), (64, 16), (0, 4), (16, 48)])
def test_pow2_with_bad_bounds(lo, hi):
    with pytest.raises(SpaceError, match=rf"pow2\({lo}, {hi}\)") as e:
        kd.pow2(lo, hi)  # <pow2>
    assert_raised_at(e, "pow2")


def test_empty_int_range():
    with pytest.raises(SpaceError):
        kd.int_range(8, 4)


def test_tunable_missing_from_the_signature():
    with pytest.raises(DSLError, match="tunable 'BLOCK_N' is not a keyword-only parameter") as e:
        @kd.kernel(tune={"BLOCK_M": kd.pow2(16, 64), "BLOCK_N": kd.pow2(16, 64)})  # <not-in-sig>
        def forgot_a_tunable(x, *, BLOCK_M):
            kd.grid(1)
    assert "forgot_a_tunable" in str(e.value)
    assert_points_at(e.value, "not-in-sig")


# ---- memory -------------------------------------------------------------------------------------------
@kd.kernel(tune={"B": kd.choice(16)})
def unchecked_load(x, *, B):
    n = x.shape[0]
    pid = kd.grid(1)
    r = kd.arange(0, B)
    v = kd.load(x, r, check=False)  # <oob>
    out = kd.output((n,), kd.f32)
    kd.store(out, r, v)
    return out


def test_unchecked_out_of_bounds_load_is_caught_by_the_reference():
    x = torch.randn(10)
    with pytest.raises(DSLError, match=r"out-of-bounds access to `x` on unchecked dim 0") as e:
        unchecked_load(x, backend="reference", config={})
    assert_points_at(e.value, "oob")
    # in bounds, the same kernel runs: the check is about the access, not the declaration
    y = torch.randn(16)
    assert torch.equal(unchecked_load(y, backend="reference", config={}), y)


def test_load_with_the_wrong_number_of_indices():
    @kd.kernel(tune={"B": kd.choice(16)})
    def one_index_for_2d(x, *, B):
        kd.grid(1)
        out = kd.output((B,), kd.f32)
        kd.store(out, kd.arange(0, B), kd.load(x, kd.arange(0, B)))  # <ndim>
        return out

    with pytest.raises(DSLError, match=r"2-d tensor `x` needs 2 index tiles, got 1") as e:
        trace(one_index_for_2d, X)
    assert_points_at(e.value, "ndim")


def test_errors_carry_the_source_line_text():
    with pytest.raises(DSLError) as e:
        trace(mismatched_shapes, X)
    assert "kd.store(out, kd.arange(0, B), a + b)" in str(e.value)


def test_load_tile_box_narrower_than_16_bytes():
    @kd.kernel(tune={"B": kd.choice(4)})
    def narrow(x, *, B):
        t = kd.load_tile(x, 0, 0, shape=(16, B))   # 4 fp32 = 16 bytes would do; 4 bf16 is 8
        out = kd.output((16, B), x.dtype)
        kd.store(out, kd.arange(0, 16)[:, None], kd.arange(0, B)[None, :], t)
        return out

    with pytest.raises(kd.DSLError, match="spans 8 bytes of bf16; TMA needs a multiple of 16"):
        narrow(torch.zeros(16, 8, dtype=torch.bfloat16), backend="reference")


def test_load_tile_offsets_are_scalars():
    @kd.kernel(tune={"B": kd.choice(16)})
    def tiled(x, *, B):
        t = kd.load_tile(x, kd.arange(0, B), 0, shape=(B, B))
        out = kd.output((B, B), x.dtype)
        kd.store(out, kd.arange(0, B)[:, None], kd.arange(0, B)[None, :], t)
        return out

    with pytest.raises(kd.DSLError, match="offsets are integer scalars"):
        tiled(torch.zeros(16, 16), backend="reference")
