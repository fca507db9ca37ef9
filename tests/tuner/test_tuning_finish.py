"""A kernel whose own outputs depend on a tunable is tuned through its declared finish (kd.kernel's tuning()):
the split decode attention's partial results change with KEYS_PER_SPLIT, so the tuner checks and times the split
followed by the merge a decode step runs (the prepared merge, for the o projection's GEMV) against the attention
formula, and every keys-per-range passes where the output is right."""

from __future__ import annotations

import pytest
import torch

from kilnx.kernels import attention_split as AS
from kilnx.kernels.prepared import PreparedX
from kilnx.tuner import gate

PROBLEM = {"B": 1, "T": 1, "Hq": 4, "Hk": 2, "D": 16, "S": 64, "ctx": 50, "dtype": "f32"}


def cases(kernel, draws=2, problem=PROBLEM):
    return gate.GateCases(kernel, lambda d: (torch.manual_seed(100 + d), kernel.make_args(problem, "cpu"))[1], draws)


@pytest.mark.parametrize("keys", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [16, 64])     # 64: whole groups a head, merged and prepared in one kernel
def test_every_keys_per_range_passes_the_gate_with_its_merge(keys, head_dim):
    kernel = AS.attention_split_kernel
    problem = {**PROBLEM, "D": head_dim}
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": keys}
    args = kernel.make_args(problem, "cpu")
    call = gate.trial_call(kernel, cfg, args)
    got = call(*args)
    assert isinstance(got, PreparedX)              # timed as the step runs it: merged, prepared for the o GEMV
    assert call.finished_values(got, *args).shape == args[0].shape     # checked as values, not the partials
    assert gate.check(kernel, call, cases(kernel, problem=problem), "cpu") < 1e-3
    # the partials alone could be checked against the spec of one keys-per-range only (here the default's, 64)
    default = kernel.default_config(*args)["KEYS_PER_SPLIT"]
    spec = gate.as_tuple(kernel.reference(*args, KEYS_PER_SPLIT=default))
    if keys != default:
        with pytest.raises(gate.GateFailure, match="shape"):
            gate.check(kernel, kernel.compile(cfg, *args), [(args, spec)], "cpu")


def test_a_wrong_merge_is_caught(monkeypatch):
    """The finished output is what the gate compares: a finish that merges only the first key range fails."""
    kernel = AS.attention_split_kernel
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": 16}           # 4 ranges over the 50-token context
    args = kernel.make_args(PROBLEM, "cpu")
    monkeypatch.setattr(kernel, "_finish", lambda parts, q, *_: AS.merge([t[:1] for t in parts], q, AS.TUNING_PREPARED))
    with pytest.raises(gate.GateFailure, match="out of tolerance"):
        gate.check(kernel, gate.trial_call(kernel, cfg, args), cases(kernel), "cpu")


def test_the_bucket_is_the_cache_length_class_and_serves_only_itself():
    q, k, v, pos = AS.attention_split_kernel.make_args(PROBLEM, "cpu")
    assert AS.attention_split_kernel.key(q, k, v, pos) == "B=1,T=1,Hq=4,Hk=2,D=16,S=64"
    long = torch.zeros(1, 2, 2113, 16)
    assert AS.attention_split_kernel.key(q, long, long, pos).endswith("S=2048")
    assert AS.attention_split_kernel.exact_buckets


def test_finish_and_its_reference_are_declared_together():
    from kilnx.dsl.kernel import KernelBase
    with pytest.raises(ValueError, match="go together"):
        KernelBase.tuning(AS.attention_merge, make_args=lambda p, d: (), problems=[], finish=lambda outs, *a: outs)
    with pytest.raises(ValueError, match="needs a finish"):
        KernelBase.tuning(AS.attention_merge, make_args=lambda p, d: (), problems=[], finished_values=lambda o, *a: o)


def test_a_tune_of_the_split_attention_admits_other_keys_per_range(sqlite_url, cpu):
    """Through the tuner's worker processes: trials of keys per range other than the default's pass the gate (timed,
    outcome ok), and the winner is stored for the cache's length class."""
    from kilnx.cache import TuningDB
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, tune_session
    from kilnx.tuner.study import TuneSettings
    from tests.tuner.helpers import load_trials
    spec = TargetSpec("attention_split_kernel", PROBLEM)
    with TuningDB(sqlite_url) as db:
        [r] = tune_session(cpu, [spec], db, Budget(120, 1), TuneSettings(trials=6, trial_timeout_s=60, rerank_rounds=2),
                           workers=1)
        stored = {s.bucket: s.config for s in db.valid_results(cpu)}
    assert r.error == "" and stored == {"B=1,T=1,Hq=4,Hk=2,D=16,S=64": r.config}
    ok = [t.params for t in load_trials(sqlite_url, r.study_name) if t.user_attrs.get("outcome") == "ok"]
    assert len({p["KEYS_PER_SPLIT"] for p in ok}) >= 2, ok
    assert not [t for t in load_trials(sqlite_url, r.study_name) if t.user_attrs.get("outcome") == "wrong"]
