"""Fixtures for the tuning-DB tests: device records. The DB URL fixtures (sqlite_url, postgres_url,
db_url) are shared with the tuner tests in tests/conftest.py."""

from __future__ import annotations

import pytest

from kilnx.runtime.device import DeviceInfo

H200 = DeviceInfo(name="NVIDIA H200", arch="sm_90", compute_capability=(9, 0), sm_count=132,
                  memory_bytes=141 * 2**30)
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", arch="sm_80", compute_capability=(8, 0), sm_count=108)


@pytest.fixture
def h200() -> DeviceInfo:
    return H200


@pytest.fixture
def a100() -> DeviceInfo:
    return A100
