"""`leaplm generate --startup`: the time to the first token and its parts, and the process's peak RSS.

  import       from the process's start (the interpreter, torch, leaplm, the command line) to the command
  load         the target's weights, config and tokenizer (Engine.startup.load_s)
  draft        the draft model, method draft only
  checks       --backend auto's timing of both engines, batch invariance (libllama), the thread check, the cost
               calibration: read from the start-up cache after the first start on a machine (docs/startup.md)
  engine       the rest of the engine's set-up (the proposer, the K policy)
  prepare      the prompt to token ids (and the command's own work up to the request's start)
  cache        the first batch's KV cache
  prefill      the prompt's forward
  first token  from the end of the prefill to the first token out (the first step)

The parts add up to the time to first token; what the process's age at the command's start cannot see (the
interpreter's own start before the process was counted) is none of them.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass

PARTS = ("import", "load", "draft", "checks", "engine", "prepare", "cache", "prefill", "first_token")


def process_age() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc against the boot clock), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()     # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in clock ticks
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class StartupReport:
    """Seconds by part (see the module docstring); time_to_first_token_s is their sum."""
    import_s: float
    load_s: float
    draft_s: float
    checks_s: float
    engine_s: float
    prepare_s: float
    cache_s: float
    prefill_s: float
    first_token_s: float
    time_to_first_token_s: float
    wall_s: float                # the whole command, to the last token printed
    peak_rss_bytes: int

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def lines(self) -> list[str]:
        rows = [(p.replace("_", " "), getattr(self, f"{p}_s")) for p in PARTS]
        w = max(len(r[0]) for r in rows)
        out = [f"time to first token {self.time_to_first_token_s:.2f} s, wall {self.wall_s:.2f} s, "
               f"peak RSS {self.peak_rss_bytes / 1e6:.0f} MB"]
        out += [f"  {name:<{w}}  {s:6.3f} s" for name, s in rows]
        return out


class StartupClock:
    """Times a generate command's start: created when the command starts, told when each part ends."""

    def __init__(self):
        self.t0 = time.perf_counter()
        age = process_age()
        self.import_s = age if age is not None else 0.0
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def report(self, engine, prefill_s: float) -> StartupReport:
        """marks needed: engine (built), run (the request started), first (its first chunk), end."""
        m, st = self.marks, engine.startup
        engine_s = m["engine"] - self.t0
        known = st.load_s + st.draft_s + st.checks_s
        first = max(0.0, m["first"] - m["run"] - st.cache_s - prefill_s)
        ttft = self.import_s + (m["first"] - self.t0)
        return StartupReport(self.import_s, st.load_s, st.draft_s, st.checks_s, max(0.0, engine_s - known),
                             m["run"] - m["engine"], st.cache_s, prefill_s, first, ttft,
                             self.import_s + (m["end"] - self.t0), peak_rss_bytes())
