"""Make `tests.tuner.fake_kernels` importable here and in tuning workers (they inherit sys.path)."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
