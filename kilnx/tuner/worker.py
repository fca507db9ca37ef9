"""Worker subprocesses that compile, check and time candidate configs.

Candidate code is untrusted in the ways that matter to a tuner: it may fail to compile, exhaust
registers or shared memory, compute wrong numbers, corrupt the CUDA context, segfault or hang. None
of that may take the tune down, so each candidate runs in a worker process with a deadline; a worker
that misses it is killed and replaced, a worker that dies is replaced, and the trial is reported as
failed with the reason. The parent keeps the Optuna study; workers only evaluate.

Workers come from a forkserver that has already imported torch (a 2 s import), so replacing a worker
costs milliseconds. CUDA is not initialised in the forkserver; each worker pins itself to its GPU
with CUDA_VISIBLE_DEVICES before touching CUDA.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from typing import Any

_STARTUP_TIMEOUT_S = 180.0
# Input seeds by purpose, in disjoint ranges: trials use small ones (their trial number), the gate's
# draws start at GATE_SEED, so a config is never checked on the inputs it is timed on.
GATE_SEED = 1_000_003
DESCRIBE_SEED = 2_000_000_001
RERANK_SEED = 2_000_000_002


@dataclass
class TrialJob:
    kernel_ref: str
    problem: dict
    config: dict
    seed: int = 0


@dataclass
class RerankJob:
    kernel_ref: str
    problem: dict
    configs: list[dict]
    rounds: int = 5
    with_peer: bool = True
    seed: int = RERANK_SEED


@dataclass
class DescribeJob:
    """Ask the kernel, on the device, for a problem's bucket, default config and heuristic seeds."""
    kernel_ref: str
    problem: dict


@dataclass
class Outcome:
    ok: bool
    time_s: float | None = None
    kind: str = ""          # on failure: compile | resource | wrong | runtime | timeout | crash
    error: str = ""
    max_err: float | None = None
    times: list[float] = field(default_factory=list)   # rerank: seconds per config (inf = failed)
    peer_time_s: float | None = None
    recycle: bool = False   # the worker's process state is suspect (e.g. CUDA error): replace it
    info: dict = field(default_factory=dict)           # describe: bucket, default_config, seed_configs


# ---------------------------------------------------------------- inside the worker process

def _classify(exc: BaseException, stage: str) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if "outofmemory" in text or "out of memory" in text or "outofresources" in text or "out of resource" in text:
        return "resource"
    return stage


def _needs_recycle(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "cuda error" in text or "illegal memory access" in text or "device-side assert" in text


class _WorkerState:
    def __init__(self, device: str):
        self.device = device
        self.kernels: dict[str, Any] = {}
        self.cases: dict[tuple, Any] = {}

    def kernel(self, ref: str):
        if ref not in self.kernels:
            from kilnx.tuner.refs import resolve
            self.kernels[ref] = resolve(ref)
        return self.kernels[ref]

    def gate_cases(self, kernel, job) -> "gate.GateCases":
        from kilnx.tuner import gate
        key = (job.kernel_ref, json.dumps(job.problem, sort_keys=True, default=str))
        if key not in self.cases:
            self.cases.clear()  # one problem at a time: large inputs must not pile up
            # and the configs recorded so far read afresh: a route's trials time the kernels it chooses between on
            # their tuned configs, which this tune may have recorded after this worker first loaded the DB
            from kilnx.runtime import dispatch
            dispatch.reset()
            self.cases[key] = gate.GateCases(kernel, lambda d: self.make_args(kernel, job.problem, GATE_SEED + d))
        return self.cases[key]

    def make_args(self, kernel, problem: dict, seed: int) -> tuple:
        import numpy as np
        import torch
        torch.manual_seed(seed)
        np.random.seed(seed % (2**32))
        return tuple(kernel.make_args(problem, self.device))


def _run_trial(job: TrialJob, st: _WorkerState) -> Outcome:
    from kilnx.tuner import gate, timing
    kernel = st.kernel(job.kernel_ref)
    args = st.make_args(kernel, job.problem, job.seed)
    try:
        fn = gate.trial_call(kernel, dict(job.config), args)
    except Exception as e:  # noqa: BLE001 - any compile failure fails the trial, not the tune
        return Outcome(False, kind=_classify(e, "compile"), error=_short(e), recycle=_needs_recycle(e))
    try:
        max_err = gate.check(kernel, fn, st.gate_cases(kernel, job), st.device)
    except gate.GateFailure as e:
        return Outcome(False, kind="wrong", error=str(e))
    except Exception as e:  # noqa: BLE001
        return Outcome(False, kind=_classify(e, "runtime"), error=_short(e), recycle=_needs_recycle(e))
    try:
        t = timing.benchmark(lambda: fn(*args), st.device)
    except Exception as e:  # noqa: BLE001
        return Outcome(False, kind=_classify(e, "runtime"), error=_short(e), recycle=_needs_recycle(e))
    return Outcome(True, time_s=t, max_err=max_err)


def _run_rerank(job: RerankJob, st: _WorkerState) -> Outcome:
    from kilnx.tuner import gate, timing
    kernel = st.kernel(job.kernel_ref)
    args = st.make_args(kernel, job.problem, job.seed)
    fns, slots = [], []
    for i, cfg in enumerate(job.configs):
        try:
            f = gate.trial_call(kernel, dict(cfg), args)
            f(*args)
        except Exception:  # noqa: BLE001 - a finalist that stops working just drops out
            continue
        fns.append(lambda f=f: f(*args))
        slots.append(i)
    peer = getattr(kernel, "peer", None) if job.with_peer else None
    if callable(peer):
        try:
            peer(*args)
            fns.append(lambda: peer(*args))
        except Exception:  # noqa: BLE001 - no peer number is better than no tune
            peer = None
    else:
        peer = None
    measured = timing.rerank_interleaved(fns, st.device, job.rounds) if fns else []
    times = [float("inf")] * len(job.configs)
    for slot, t in zip(slots, measured):
        times[slot] = t
    peer_t = measured[-1] if peer is not None and measured else None
    return Outcome(True, time_s=min(times) if times else None, times=times, peer_time_s=peer_t)


def _run_describe(job: DescribeJob, st: _WorkerState) -> Outcome:
    kernel = st.kernel(job.kernel_ref)
    args = st.make_args(kernel, job.problem, DESCRIBE_SEED)
    seeds = getattr(kernel, "seed_configs", None)
    info = {"bucket": str(kernel.key(*args)), "default_config": dict(kernel.default_config(*args)),
            "seed_configs": [dict(c) for c in seeds(job.problem)] if callable(seeds) else []}
    return Outcome(True, info=info)


_HANDLERS = {TrialJob: _run_trial, RerankJob: _run_rerank, DescribeJob: _run_describe}


def _short(e: BaseException, limit: int = 2000) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text[-limit:]


def _worker_main(conn, device: str, visible_devices: str | None, threads: int, environ: dict) -> None:
    # The forkserver's environment is the parent's from when it started; take the parent's current one
    # (TRITON_*, CUDA_*, anything set since) before anything reads it.
    os.environ.clear()
    os.environ.update(environ)
    # Lead a process group of our own, so killing a hung worker also ends what it started (a ptxas
    # still compiling a pathological config would otherwise outlive it).
    os.setpgrp()
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    import torch
    torch.set_num_threads(threads)
    st = _WorkerState(device)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        job_id, job = msg
        try:
            out = _HANDLERS[type(job)](job, st)
        except BaseException as e:  # noqa: BLE001 - report everything; the parent decides
            out = Outcome(False, kind=_classify(e, "runtime"), error=_short(e), recycle=_needs_recycle(e))
        conn.send((job_id, out))
        if out.recycle:
            return


# ---------------------------------------------------------------- in the tuning process

def _context():
    """A forkserver that preloads torch where available (fast replacement), else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "kilnx.tuner.worker"])
        return ctx
    return mp.get_context("spawn")


class Worker:
    """One evaluation subprocess, its pipe, and the deadline of the job it is running."""

    def __init__(self, index: int, device: str, visible_devices: str | None, threads: int):
        self.index, self.device, self.visible, self.threads = index, device, visible_devices, threads
        self.proc = None
        self.conn = None
        self.ready = False
        self.job_id: int | None = None
        self.deadline = 0.0
        self.started_at = 0.0
        self.failed_starts = 0  # consecutive deaths before "ready": a broken environment, not a kernel
        self.start()

    def start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, daemon=True, name=f"kilnx-tune-worker-{self.index}",
                                args=(child, self.device, self.visible, self.threads, dict(os.environ)))
        self.proc.start()
        child.close()
        self.conn, self.ready, self.job_id = parent, False, None
        self.started_at = time.monotonic()

    def kill(self) -> None:
        if self.proc is not None and self.proc.pid is not None:
            try:  # the worker's own group (see _worker_main); only our worker leads it
                if os.getpgid(self.proc.pid) == self.proc.pid:
                    os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(timeout=5)
        if self.conn is not None:
            self.conn.close()

    def restart(self) -> None:
        self.kill()
        self.start()

    def send(self, job_id: int, job: Any, timeout_s: float) -> None:
        self.job_id = job_id
        self.deadline = time.monotonic() + timeout_s
        self.conn.send((job_id, job))

    @property
    def idle(self) -> bool:
        return self.ready and self.job_id is None


class WorkerPool:
    """N workers; submit jobs to idle ones and collect outcomes, turning hangs and crashes into failures."""

    def __init__(self, n: int, device: str, visible: list[str | None] | None = None, threads: int | None = None):
        cores = os.cpu_count() or 1
        threads = threads or max(1, cores // max(1, n))
        visible = visible or [None] * n
        self.workers = [Worker(i, device, visible[i], threads) for i in range(n)]
        self._next_id = 0
        self._lost: list[tuple[int, Outcome]] = []   # jobs whose worker was gone before they reached it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for w in self.workers:
            try:
                if w.proc.is_alive() and w.idle:
                    w.conn.send(None)
                    w.proc.join(timeout=2)
            except (OSError, BrokenPipeError):
                pass
            w.kill()

    def idle_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.idle]

    def busy(self) -> int:
        return sum(1 for w in self.workers if w.job_id is not None)

    def submit(self, worker: Worker, job: Any, timeout_s: float) -> int:
        self._next_id += 1
        try:
            worker.send(self._next_id, job, timeout_s)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            # the worker died while idle (a crash its last job left behind): the job fails, the worker
            # is replaced, the tune goes on
            code = worker.proc.exitcode if worker.proc is not None else None
            self._lost.append((self._next_id, Outcome(False, kind="crash",
                                                      error=f"worker gone before the job (exit code {code}): {e!r}")))
            worker.restart()
        return self._next_id

    def wait(self, timeout_s: float | None = None) -> list[tuple[int, Outcome]]:
        """Outcomes of jobs that finished (or were killed) within `timeout_s`; also brings up workers."""
        if self._lost:
            lost, self._lost = self._lost, []
            return lost
        now = time.monotonic()
        deadlines = [w.deadline for w in self.workers if w.job_id is not None]
        deadlines += [w.started_at + _STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
        if timeout_s is not None:
            wait_s = min(wait_s, timeout_s) if deadlines else timeout_s
        handles = {}
        for w in self.workers:
            handles[w.conn] = w
            handles[w.proc.sentinel] = w
        ready = wait_for(list(handles), timeout=wait_s)
        done: list[tuple[int, Outcome]] = []
        seen = set()
        for h in ready:
            w = handles[h]
            if id(w) in seen:
                continue
            seen.add(id(w))
            done += self._drain(w)
        now = time.monotonic()
        for w in self.workers:
            if w.job_id is not None and now > w.deadline:
                done.append((w.job_id, Outcome(False, kind="timeout",
                                               error=f"no result within the trial timeout; worker killed")))
                w.restart()
            elif not w.ready and now > w.started_at + _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"tuning worker {w.index} did not start within {_STARTUP_TIMEOUT_S:.0f}s")
        return done

    def _drain(self, w: Worker) -> list[tuple[int, Outcome]]:
        done = []
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready, w.failed_starts = True, 0
                    continue
                job_id, out = msg
                if job_id == w.job_id:
                    done.append((job_id, out))
                    w.job_id = None
                if out.recycle:
                    w.restart()
                    return done
        except (EOFError, OSError):
            pass
        if not w.proc.is_alive():
            if not w.ready:
                w.failed_starts += 1
                if w.failed_starts >= 3:
                    raise RuntimeError(
                        f"tuning worker {w.index} exited during start-up {w.failed_starts} times (exit code "
                        f"{w.proc.exitcode}); if you call the tuner from a script, guard it with "
                        f"`if __name__ == '__main__':`")
            if w.job_id is not None:
                code = w.proc.exitcode
                done.append((w.job_id, Outcome(False, kind="crash",
                                               error=f"worker process died (exit code {code})")))
            w.restart()
        return done

    def run(self, job: Any, timeout_s: float) -> Outcome:
        """Run one job on the first idle worker and wait for it (used for the final re-rank)."""
        while not self.idle_workers():
            self.wait(1.0)
        job_id = self.submit(self.idle_workers()[0], job, timeout_s)
        while True:
            for jid, out in self.wait():
                if jid == job_id:
                    return out
