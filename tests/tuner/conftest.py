"""Fixtures for tuner tests: fake kernels importable here and in workers, and a CPU device.

The DB URL fixtures (sqlite_url, postgres_url, db_url) are shared, in tests/conftest.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # workers inherit sys.path, so "tests.tuner.fake_kernels:..." resolves there too
    sys.path.insert(0, ROOT)


@pytest.fixture
def cpu():
    from kilnx.runtime.device import detect
    return detect("cpu")

