"""A kernel call launches with the config tuned for its device and shape bucket, never a stale one."""

from __future__ import annotations

import pytest
import torch

from kilnx.cache import TuningDB
from kilnx.kernels import norms
from kilnx.runtime import dispatch
from kilnx.runtime.device import cpu_info


@pytest.fixture
def db(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/tuned.db"
    monkeypatch.setenv("KILNX_DB", url)
    dispatch.reset()
    yield TuningDB(url)
    dispatch.reset()


def args():
    return (torch.randn(8, 96), torch.randn(96))


def record(db, config, source_hash=None, bucket=None):
    k = norms.rms_norm_kernel
    db.record_result(kernel=k.name, source_hash=source_hash or k.source_hash, device=cpu_info(),
                     bucket=bucket or k.key(*args()), config=config, time_s=1e-5)


def test_tuned_config_is_used_for_its_bucket(db):
    record(db, {"ROWS": 4, "BLOCK_D": 128, "num_warps": 2})
    cfg = dispatch.config_for(norms.rms_norm_kernel, args(), {})
    assert cfg == {"ROWS": 4, "BLOCK_D": 128, "num_warps": 2}


def test_nearest_bucket_serves_an_untuned_shape(db):
    k = norms.rms_norm_kernel
    record(db, {"ROWS": 2, "BLOCK_D": 128, "num_warps": 1}, bucket=k.key(torch.randn(64, 96), torch.randn(96)))
    assert dispatch.config_for(k, args(), {})["ROWS"] == 2


def test_stale_source_hash_falls_back_to_the_default(db):
    record(db, {"ROWS": 4, "BLOCK_D": 128, "num_warps": 2}, source_hash="0" * 64)
    k = norms.rms_norm_kernel
    assert dispatch.config_for(k, args(), {}) == k.default_config(*args())


def test_the_call_path_runs_the_tuned_config_and_stays_correct(db):
    record(db, {"ROWS": 4, "BLOCK_D": 64, "num_warps": 2})   # looped lowering: 96 > 64 columns
    x, w = args()
    y = norms.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    compiled = [spec for spec in norms.rms_norm_kernel._compiled if ("ROWS", 4) in spec[1]]
    assert compiled, "the tuned config was not the one compiled"
