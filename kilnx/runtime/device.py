"""What device this process runs on, and whether it matches what the user asked for.

A device's identity (`DeviceInfo.key`) is what tuned results are keyed by: the architecture (sm_XX or
cpu) and the product name. Results tuned on one GPU are never served on another.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field


class DeviceError(RuntimeError):
    """The requested device is not this machine's; the message says what was found and the way out."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str                      # "NVIDIA H200" or the CPU model
    arch: str                      # "sm_90", "sm_121", or "cpu"
    compute_capability: tuple[int, int] | None = None
    sm_count: int = 0              # multiprocessors (GPU) or cores (CPU)
    memory_bytes: int = 0
    driver: str = ""
    index: int = 0                 # cuda:N
    copy_bandwidth_gbps: float | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.arch}:{self.name}"

    @property
    def is_cuda(self) -> bool:
        return self.arch != "cpu"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.is_cuda else "cpu"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        d = dict(d)
        cc = d.get("compute_capability")
        d["compute_capability"] = tuple(cc) if cc else None
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def cpu_info() -> DeviceInfo:
    import os
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return DeviceInfo(name=name, arch="cpu", sm_count=os.cpu_count() or 1, memory_bytes=mem)


def cuda_info(index: int = 0) -> DeviceInfo:
    import torch
    p = torch.cuda.get_device_properties(index)
    driver = ""
    try:
        driver = str(torch.version.cuda or "")
    except Exception:  # noqa: BLE001 - driver string is informational only
        pass
    return DeviceInfo(name=p.name, arch=f"sm_{p.major}{p.minor}", compute_capability=(p.major, p.minor),
                      sm_count=p.multi_processor_count, memory_bytes=p.total_memory, driver=driver,
                      index=index)


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001
        return False


def detect(request: str = "auto") -> DeviceInfo:
    """Resolve `--device` (auto | cpu | cuda | cuda:N | sm_XX) to this machine's device, or raise.

    Raises DeviceError naming what was found and how to proceed when the request cannot be met here.
    """
    req = request.strip().lower()
    if req == "cpu":
        return cpu_info()
    has_cuda = cuda_available()
    if req == "auto":
        return cuda_info(0) if has_cuda else cpu_info()
    found = _describe_found(has_cuda)
    if req == "cuda" or req.startswith("cuda:"):
        if not has_cuda:
            raise DeviceError(f"--device {request}: no CUDA GPU is visible here ({found}). "
                              "Use --device cpu, or run on a machine with an NVIDIA GPU.")
        idx = int(req.split(":", 1)[1]) if ":" in req else 0
        import torch
        if idx >= torch.cuda.device_count():
            raise DeviceError(f"--device {request}: only {torch.cuda.device_count()} GPU(s) here ({found}).")
        return cuda_info(idx)
    if req.startswith("sm_"):
        if has_cuda:
            import torch
            for i in range(torch.cuda.device_count()):
                info = cuda_info(i)
                if info.arch == req:
                    return info
        raise DeviceError(f"--device {request}: this machine has {found}. Tune on a {request} machine and "
                          f"bring its results here with `kilnx db export` there and `kilnx db import` here.")
    raise DeviceError(f"--device {request}: not understood; use auto, cpu, cuda, cuda:N or sm_XX (e.g. sm_90).")


def _describe_found(has_cuda: bool) -> str:
    if not has_cuda:
        return "no CUDA GPU, only the CPU"
    import torch
    names = [f"cuda:{i} {cuda_info(i).name} ({cuda_info(i).arch})" for i in range(torch.cuda.device_count())]
    return ", ".join(names)
