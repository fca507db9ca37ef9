"""Which kernel serves a quantized matmul of one weight at one row count: a tuned, stored choice per (weight, rows).

Why not only the thresholds of kernels/routing.py: there one config per weight (GEMV up to QMV_MAX_ROWS rows, wgmma
from WG_MIN_ROWS, the repacked copy or not, ...) was tuned on one objective, the sum of a sweep of calls at 1 to 32
rows. On the H100 a 100 s `kilnx tune --model llama-3.1-8b` of it took the copy off gate_up and down and raised the
wgmma threshold, ahead on the sweep by 1.04-1.20x, and the tuned model decoded 4 rows at 0.88x the untuned rate
(bench/results/2026-12-06_h100_batch_decode_route_tuned_s32.csv): the 32-row call outweighed the rows a decode step
runs, and TPE over coupled thresholds did not find the combination that won each row count. Here each row count the
engine's decode graphs run (1, 2, 4, 8, 16) is its own bucket with one categorical choice among the kernels of
routing.PATHS. Timed one call at a time (session 33, the generic tuner's trial), the two paths that won on the
H100 (qmv_h2 for o at 4 rows, 7% ahead alone; qmm_wg for down at 2, 3.5%) decoded llama-3.1-8b at 0.98x / 0.95x the
untuned rate (bench/results/2026-12-06_h100_*paths*_s33.csv): a call alone is not the call a step pays. So this
route is tuned in the model's decode step only (tuner/step_paths.py, `kilnx tune --model M --kernel qmatmul_path`),
and its stored times are step times.

Where nothing is stored the choice is the thresholds' own path (stored or default), so the runtime's answer is the
same as before tuning. A path that does not serve the call (qmv_tc past 64 rows, the wgmma kernels on another
format) fails to compile: a failed trial, never a stored result.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from kilnx.dsl.kernel import Route, _tuning_generation, forget_remembered_configs, format_key
from kilnx.dsl.tunables import Space, choice
from kilnx.kernels.routing import PATHS, ROUTING_VERSION, qmatmul_rows

# 2: tuned in the engine's decode step only (tuner/step_paths.py): results hold step times, and version 1's
# one-call results (call times, the trial that misled) are stale
PATH_VERSION = "2"
ROWS = (1, 2, 4, 8, 16)
MAX_ROWS = ROWS[-1]    # the largest bucket tuned; more rows take the thresholds' rule


@dataclass
class TrialCall:
    """A qmatmul call shape a decode step asked for during a PathTrial."""
    rows: int
    serving: tuple[str, ...]       # the PATHS that can multiply it
    default: str                   # the thresholds' path
    nbytes: int                    # the weight's packed bytes with its scales and biases


@dataclass
class PathTrial:
    """Paths forced by bucket while a tuner captures a decode step (QmatmulPathRoute.trying); every bucket asked
    meanwhile is noted in `asked`. Buckets not in `paths` take the thresholds' path: stored paths are set aside."""
    paths: dict[str, str]
    asked: dict[str, TrialCall] = field(default_factory=dict)


class QmatmulPathRoute(Route):
    """`PATH` for one qmatmul call shape: x (M, K) of 16-bit activations by a packed weight (N, K). The bucket is
    the weight's shape and format (one string field, so that no other weight's choice is ever the nearest) and M."""

    name = "qmatmul_path"
    version = PATH_VERSION + ROUTING_VERSION
    # a stored path holds for its own row count only: another count's winner (qmv_h2 at 4 rows) could be the
    # slowest kernel at the rows between (16); those take the thresholds' path
    exact_buckets = True

    def __init__(self):
        from kilnx.kernels import qmatmul as qm
        self._qm = qm
        self.space = Space({"PATH": choice(*PATHS, default="qmv_h2")})
        self._chosen: dict = {}
        self._trial: PathTrial | None = None

    def chosen_between(self) -> tuple:
        return qmatmul_rows.chosen_between()

    # -- protocol -------------------------------------------------------------------------------------
    def key(self, x, wq, scales, biases, *_, **__) -> str:
        f = self._qm._format_of(x, wq, scales, biases)
        return format_key({"W": f"{wq.shape[0]}x{x.shape[1]}b{f['BITS']}g{f['GROUP']}", "M": x.shape[0]})

    def default_config(self, x, wq, scales, biases, *_, **__) -> dict:
        """The thresholds' path for this call: what qmatmul runs when no path is stored."""
        chosen = qmatmul_rows.thresholds_for(x, wq, scales, biases)
        return self.space.validate({"PATH": qmatmul_rows.rule_path(x, wq, scales, biases, chosen)})

    def sample_problems(self) -> list[dict]:
        return [{"N": 4096, "K": 4096, "bits": 4, "gs": 64, "M": 4}]

    def make_args(self, problem: dict, device: str):
        return self._qm.make_qmatmul_args(problem, device)

    def compile(self, config: dict, x, wq, scales, biases, *, backend: str | None = None, **_):
        """One call on the path `config` names (the kernel tests' and a direct tune_session's; a model's tune times
        paths in its decode step instead, tuner/step_paths.py)."""
        path = self.space.validate(config)["PATH"]
        server = qmatmul_rows.server_of_path(path, x, wq, scales, biases, backend=backend)
        return lambda x, wq, scales, biases, *_: server(x, wq, scales, biases)

    def tolerance(self, args):
        return self._qm._matmul_tolerance(tuple(args[:4]))

    def reference(self, x, wq, scales, biases, *_, **__):
        f = self._qm._format_of(x, wq, scales, biases)
        return self._qm._dense_spec(x, wq, scales, biases, f["BITS"], f["GROUP"])

    # -- the choice itself ----------------------------------------------------------------------------
    def path_for(self, x, wq, scales, biases) -> str:
        """The stored path for this device, weight and row count (the thresholds' path where none was
        tuned), looked up once per (device, weight shape, rows) until the runtime reloads tuned configs."""
        memo = (x.device, x.dtype, x.shape, wq.shape, scales.shape, _tuning_generation[0])
        got = self._chosen.get(memo)
        if got is None:
            if self._trial is not None:
                got = self._chosen[memo] = self._trial_path(self._trial, x, wq, scales, biases)
            else:
                from kilnx.runtime.dispatch import config_for
                got = self._chosen[memo] = config_for(self, (x, wq, scales, biases), {})["PATH"]
        return got

    # -- the engine's trial (tuner/step_paths.py) -------------------------------------------------------
    @contextmanager
    def trying(self, paths: dict[str, str]):
        """Within: calls of a bucket in `paths` take that path (where it serves them), others the thresholds' path,
        whatever is stored; yields the PathTrial, whose `asked` notes each bucket the calls meanwhile asked for.
        Remembered choices are dropped on the way in and out, so what is captured inside takes the trial's paths
        and what runs after takes the stored ones again."""
        if self._trial is not None:
            raise RuntimeError("qmatmul_path.trying: a trial is already open")
        trial = PathTrial(dict(paths))
        self._trial = trial
        forget_remembered_configs()
        try:
            yield trial
        finally:
            self._trial = None
            forget_remembered_configs()

    def _trial_path(self, trial: PathTrial, x, wq, scales, biases) -> str:
        bucket = self.key(x, wq, scales, biases)
        default = self.default_config(x, wq, scales, biases)["PATH"]
        if bucket not in trial.asked:
            serving = tuple(p for p in PATHS if qmatmul_rows.serves(p, x, wq, scales, biases))
            nbytes = sum(t.numel() * t.element_size() for t in (wq, scales, biases) if t is not None)
            trial.asked[bucket] = TrialCall(x.shape[0], serving, default, nbytes)
        wanted = trial.paths.get(bucket, default)
        return wanted if wanted in trial.asked[bucket].serving else default


qmatmul_path = QmatmulPathRoute()

__all__ = ["qmatmul_path", "QmatmulPathRoute", "MAX_ROWS", "ROWS"]
