"""Tunables and Space: what a kernel author declares and what the tuner searches.

A config is a plain dict name -> value. A Space knows each tunable's candidates and default, fills
partial configs with defaults, rejects what is not in it, and checks constraints over whole configs.
Optuna sees each tunable as one categorical; constraints are checked after drawing (the tuner prunes).
"""

from __future__ import annotations

import json

import optuna
import pytest

import kilnx.dsl as kd
from kilnx.dsl import Space, SpaceError

optuna.logging.set_verbosity(optuna.logging.WARNING)


# ---- single tunables ----------------------------------------------------------------------------------
def test_pow2_is_the_powers_of_two_between_its_bounds_with_the_middle_as_default():
    t = kd.pow2(16, 256)
    assert t.values == (16, 32, 64, 128, 256)
    assert t.default == 64
    assert kd.pow2(1, 1).values == (1,) and kd.pow2(1, 1).default == 1
    assert kd.pow2(16, 256, default=16).default == 16


@pytest.mark.parametrize("make", [lambda: kd.pow2(16, 64, default=48), lambda: kd.choice(1, 2, default=3),
                                  lambda: kd.int_range(1, 4, default=7)])
def test_a_default_outside_the_values_is_rejected(make):
    with pytest.raises(SpaceError, match="is not one of"):
        make()


def test_int_range_is_inclusive_and_stepped():
    assert kd.int_range(1, 4).values == (1, 2, 3, 4)
    assert kd.int_range(2, 9, step=3).values == (2, 5, 8)
    assert kd.int_range(2, 9, step=3).default == 2


def test_choice_defaults_to_its_first_value_and_keeps_order():
    assert kd.choice("a", "b").values == ("a", "b")
    assert kd.choice("a", "b").default == "a"
    assert kd.choice(8, 2, 4, default=4).values == (8, 2, 4)
    assert kd.choice(0, 1).default == 0          # a falsy first value is still the default


def test_boolean():
    assert kd.boolean().values == (False, True) and kd.boolean().default is False
    assert kd.boolean(default=True).default is True


# ---- spaces -------------------------------------------------------------------------------------------
def tile_space() -> Space:
    return Space({"BLOCK_M": kd.pow2(16, 64), "BLOCK_K": kd.pow2(16, 64), "SPLIT": kd.choice(1, 2, 4),
                  "num_warps": kd.choice(4, 8)},
                 constraints=(lambda BLOCK_M, BLOCK_K: BLOCK_M * BLOCK_K <= 2048,
                              lambda SPLIT, num_warps: SPLIT * num_warps <= 16))


def test_default_is_every_tunables_default():
    assert tile_space().default() == {"BLOCK_M": 32, "BLOCK_K": 32, "SPLIT": 1, "num_warps": 4}


def test_validate_fills_missing_names_with_defaults():
    s = tile_space()
    assert s.validate({}) == s.default()
    assert s.validate({"BLOCK_K": 16, "SPLIT": 4}) == {"BLOCK_M": 32, "BLOCK_K": 16, "SPLIT": 4, "num_warps": 4}


def test_validate_rejects_unknown_names_values_outside_and_broken_constraints():
    s = tile_space()
    with pytest.raises(SpaceError, match=r"unknown tunables \['BLOCK_N'\]"):
        s.validate({"BLOCK_N": 16})
    with pytest.raises(SpaceError, match="BLOCK_M=48 is not one of"):
        s.validate({"BLOCK_M": 48})
    with pytest.raises(SpaceError, match="breaks a constraint"):
        s.validate({"BLOCK_M": 64, "BLOCK_K": 64})
    with pytest.raises(SpaceError, match="breaks a constraint"):
        s.validate({"SPLIT": 4, "num_warps": 8})


def test_is_valid_checks_only_constraints():
    s = tile_space()
    assert s.is_valid({"BLOCK_M": 64, "BLOCK_K": 32, "SPLIT": 2, "num_warps": 8})
    assert not s.is_valid({"BLOCK_M": 64, "BLOCK_K": 64, "SPLIT": 1, "num_warps": 4})


def test_a_constraint_naming_an_unknown_tunable_is_rejected_at_definition():
    with pytest.raises(SpaceError, match=r"unknown tunables \['BLOCK_N'\]"):
        Space({"BLOCK_M": kd.pow2(16, 64)}, constraints=(lambda BLOCK_M, BLOCK_N: True,))


def test_a_default_that_breaks_a_constraint_is_rejected_at_definition():
    with pytest.raises(SpaceError, match="default config"):
        Space({"A": kd.choice(1, 2), "B": kd.choice(1, 2)}, constraints=(lambda A, B: A != B,))


def test_iteration_yields_exactly_the_valid_configs_in_declaration_order():
    s = tile_space()
    configs = list(s)
    assert s.size() == 3 * 3 * 3 * 2
    brute = [{"BLOCK_M": m, "BLOCK_K": k, "SPLIT": sp, "num_warps": w}
             for m in (16, 32, 64) for k in (16, 32, 64) for sp in (1, 2, 4) for w in (4, 8)]
    assert configs == [c for c in brute if c["BLOCK_M"] * c["BLOCK_K"] <= 2048 and c["SPLIT"] * c["num_warps"] <= 16]
    assert len(configs) == 8 * 5
    for c in configs:
        assert s.validate(c) == c
        assert json.loads(json.dumps(c)) == c      # configs are plain JSON


def test_an_empty_space_has_one_config():
    s = Space()
    assert s.default() == {} and list(s) == [{}] and s.validate({}) == {}


# ---- Optuna -------------------------------------------------------------------------------------------
def test_suggest_draws_each_tunable_as_a_categorical_over_its_values():
    s = tile_space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = []
    for _ in range(40):
        trial = study.ask()
        cfg = s.suggest(trial)
        assert set(cfg) == set(s.params)
        for name, value in cfg.items():
            assert value in s.params[name].values
            dist = trial.distributions[name]
            assert isinstance(dist, optuna.distributions.CategoricalDistribution)
            assert tuple(dist.choices) == s.params[name].values
        seen.append(cfg)
        study.tell(trial, 1.0)
    # constraints are not applied while drawing: the tuner checks is_valid and prunes
    assert any(not s.is_valid(c) for c in seen)
    assert any(s.is_valid(c) for c in seen)


def test_suggest_replays_a_fixed_config():
    """The tuner enqueues the default first; suggest must hand back exactly that config."""
    s = tile_space()
    study = optuna.create_study()
    want = {"BLOCK_M": 16, "BLOCK_K": 64, "SPLIT": 2, "num_warps": 8}
    study.enqueue_trial(want)
    assert s.suggest(study.ask()) == want


def test_kernel_spaces_validate_configs_passed_to_compile():
    @kd.kernel(tune={"B": kd.pow2(16, 64)})
    def copy(x, *, B):
        n = x.shape[0]
        pid = kd.grid(kd.cdiv(n, B))
        r = pid * B + kd.arange(0, B)
        out = kd.output((n,), x.dtype)
        kd.store(out, r, kd.load(x, r))
        return out

    import torch
    x = torch.arange(40, dtype=torch.float32)
    assert copy.default_config(x) == {"B": 32}
    assert torch.equal(copy(x, backend="reference", config={"B": 16}), x)
    with pytest.raises(SpaceError, match="B=24 is not one of"):
        copy(x, backend="reference", config={"B": 24})


KERNEL_WITH_HELPER = """
import kilnx.dsl as kd


def decode(v):
    return v * {factor}


@kd.kernel(tune={{"BLOCK": kd.choice(16)}})
def scaled(x, *, BLOCK):
    r = kd.arange(0, BLOCK)
    out = kd.output((16,), kd.f32)
    kd.store(out, r, [decode(v) for v in [kd.load(x, r).f32()]][0])
    return out
"""


def _kernel_from(tmp_path, name, factor):
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text(KERNEL_WITH_HELPER.format(factor=factor))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.scaled


def test_a_change_in_a_traced_helper_changes_the_source_hash(tmp_path):
    """Tuned configs are keyed by the source hash: editing a helper the kernel calls (here from inside
    a comprehension) must make them stale, although the kernel's own text is the same."""
    a, b, a2 = (_kernel_from(tmp_path, n, f) for n, f in (("mod_a", 2.0), ("mod_b", 3.0), ("mod_a2", 2.0)))
    assert a.source_hash != b.source_hash
    assert a.source_hash == a2.source_hash


KERNEL_ABOVE_ITS_HELPERS = """
import kilnx.dsl as kd


@kd.kernel(tune={{"BLOCK": kd.choice(16)}})
def scaled(x, *, BLOCK):
    r = kd.arange(0, BLOCK)
    out = kd.output((16,), kd.f32)
    kd.store(out, r, EPILOGUES["twice"](decode(kd.load(x, r).f32())))
    return out


def decode(v):
    return v * {factor}


EPILOGUES = {{"twice": lambda v: v * {twice}}}
"""


@pytest.mark.parametrize("edit", ["helper", "table"])
def test_helpers_defined_below_the_kernel_count_in_its_hash(tmp_path, edit):
    """The common order (the kernel first, its helpers below it, tables of helpers by name) is hashed as the
    module ends up, not as it stood when the decorator ran: editing `decode` or a lambda of `EPILOGUES` makes the
    stored configs stale."""
    import importlib.util

    def load(name, factor, twice):
        path = tmp_path / f"{name}.py"
        path.write_text(KERNEL_ABOVE_ITS_HELPERS.format(factor=factor, twice=twice))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.scaled
    a, a2 = load("below_a", 2.0, 2.0), load("below_a2", 2.0, 2.0)
    b = load("below_b", 3.0, 2.0) if edit == "helper" else load("below_b", 2.0, 3.0)
    assert a.source_hash == a2.source_hash
    assert a.source_hash != b.source_hash


def test_the_source_hash_covers_helper_modules_and_classes():
    """The GEMVs trace `gemv.Frame` methods through a module attribute: the text hashed for them must
    hold that class, or editing the shared frame would leave their tuned configs looking current."""
    from kilnx.dsl.kernel import traced_source
    from kilnx.kernels import qmatmul, qmv_h2
    for kernel in (qmatmul.qmv, qmv_h2.qmv_h2):
        text = traced_source(kernel.fn)
        assert "class Frame" in text and "def per_group" in text and "def into_row" in text
    assert "class Frame" not in traced_source(qmatmul.mm.fn)   # a kernel that does not use it


def test_a_register_cap_in_a_config_reaches_the_compiled_kernel():
    """`maxnreg` is a launch knob like num_warps: a kernel's space may declare it, and its value caps the
    registers per thread in the PTX (compiled for sm_90 here, no GPU needed); 0 leaves the compiler's choice.
    (Measured on the H200 for qmv_h2, caps of 40-64 were no faster on any llama-3.1-8b GEMV,
    bench/results/2026-12-03_h200_quant_s12_maxnreg.csv, so no library kernel declares it yet.)"""
    import subprocess
    import sys
    code = """
import torch
import kilnx.dsl as kd
from kilnx.codegen.aot import compile_for_target

@kd.kernel(tune={"B": kd.choice(64), "maxnreg": kd.choice(0, 48, default=0)})
def twice(x, *, B):
    i = kd.grid(1) * B + kd.arange(0, B)
    out = kd.output((x.shape[0],), kd.f32)
    kd.store(out, i, kd.load(x, i) * 2.0)
    return out

for reg in (48, 0):
    ptx = compile_for_target(twice, (torch.zeros(64),), {"B": 64, "maxnreg": reg}).asm["ptx"]
    print(".maxnreg 48" in ptx)
"""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # a real compile, not the interpreter
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.stdout.split() == ["True", "False"], (r.stdout, r.stderr[-3000:])
