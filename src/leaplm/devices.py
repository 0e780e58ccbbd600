"""Device names at the boundary: a device that is misspelt or absent on this machine is refused, naming the
field (--device, --draft-device), before any weights are loaded. And the memory this machine has available, which
the backend choice (models/loading.py) and the server's admission (server/admission.py) both read."""
from __future__ import annotations

import re

from .config import ConfigError

_DEVICE = re.compile(r"^(cpu|mps|cuda|xpu)(:(\d+))?$")


def check_device(name: str, field: str = "device") -> str:
    import torch

    m = _DEVICE.match(name or "")
    if not m:
        raise ConfigError(field, f"unknown device {name!r}; expected cpu, cuda, cuda:N, mps or xpu")
    kind, index = m.group(1), m.group(3)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(field, f"{name!r}: the CPU has only index 0")
        return name
    backend = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
    available = bool(backend is not None and backend.is_available())
    if not available:
        raise ConfigError(field, f"device {name!r} is not available on this machine (torch {torch.__version__} "
                                 f"sees no {kind}); use cpu")
    if index is not None and kind != "mps" and int(index) >= backend.device_count():
        raise ConfigError(field, f"device {name!r}: this machine has {backend.device_count()} {kind} device(s)")
    return name


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
