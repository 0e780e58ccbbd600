"""What a batched target forward costs: seconds over n rows of T tokens, as a level per n times a shape per (n, T).

The level is what a forward costs now; it moves with the machine's load (other processes, thermal state), so
every live forward refreshes its n's level, whatever its T. The shape is what T tokens cost relative to the
others at the same n (a property of the model and its kernels: on a CPU a forward over a few tokens costs about
what one costs, or a fixed step more where the matrix kernels switch from vector to matrix code). Kept apart,
a K > 0 priced from a block cost measured at start-up on a loaded machine is not compared with a K = 0 priced
from a one-token cost measured later on a quiet one: the comparison rests on the shape, measured pairwise.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class BatchCostModel:
    """Seconds per batched target forward over n rows of T tokens (interpolated between measured n and T)."""
    level: dict[int, float] = field(default_factory=dict)             # n -> seconds of the reference forward
    shape: dict[tuple[int, int], float] = field(default_factory=dict)  # (n, T) -> its cost / the level
    ref: dict[int, int] = field(default_factory=dict)                  # n -> the reference T (shape 1)
    weight: dict[tuple[int, int], float] = field(default_factory=dict)  # (n, T) -> 1 + live refinements (<= 100)
    decay: float = 0.9               # level: follows the load within a few steps
    shape_decay: float = 0.97        # shape: live steps refine it slowly
    # The shape of T is refined only while the reference T is measured too (within this many forwards at n): a
    # stretch of forwards at one T cannot tell a change of load from a change of shape, and the level takes it.
    ref_window: int = 8
    _since_ref: dict[int, int] = field(default_factory=dict)
    # n's whose level a live forward has set: the first live forward replaces the start-up level (measured at
    # another time, or read from the start-up cache of another process, at another load: off by up to 2x on a
    # shared machine, which a request's first steps then measured against)
    _live: set[int] = field(default_factory=set)
    _mono: dict[int, dict[int, float]] = field(default_factory=dict)   # n -> _monotone(n), until n changes

    def observe(self, n: int, T: int, seconds: float) -> None:
        """A live forward's time: refreshes the level of n, then (slowly) the shape of (n, T)."""
        self._mono.pop(n, None)
        if n not in self.level:
            self.level[n], self.ref[n] = seconds, T
            self.shape[(n, T)] = 1.0
            return
        if (n, T) not in self.shape:
            self.shape[(n, T)] = seconds / self.level[n]
            return
        d = self.decay if n in self._live else 0.0
        self._live.add(n)
        self.level[n] = d * self.level[n] + (1 - d) * seconds / self.shape[(n, T)]
        since = 0 if T == self.ref[n] else self._since_ref.get(n, self.ref_window) + 1
        self._since_ref[n] = since
        if 0 < since <= self.ref_window:
            s = self.shape_decay
            self.shape[(n, T)] = s * self.shape[(n, T)] + (1 - s) * seconds / self.level[n]
            self.weight[(n, T)] = min(100.0, self.weight.get((n, T), 1.0) + 1.0)

    def live(self, n: int) -> bool:
        """A live forward at n has set its level (until then, cost(n, .) is the start-up's figure)."""
        return n in self._live

    def calibrated(self, n: int, rounds: list[dict[int, float]]) -> None:
        """Start-up measurements at n rows: rounds of {T: seconds}, each round's T's measured back to back. The
        shape of T is its fastest time over the rounds relative to the smallest T's fastest; the level is the
        median time of that smallest T (what a forward costs now, load included).

        Why the fastest: a forward's time is its cost plus interference (another process on the core, one of the
        kernel's threads descheduled), and interference only adds. On a machine whose other core ran a training
        job, one forward of the same shape took anywhere from 1x to 10x its fastest time, so ratios of single
        forwards (the median of three paired ratios) put a block of 2 tokens at 1.0x to 8.9x one token from one
        start-up to the next, and the K policy drafted or not by chance. The fastest of a few rounds is the time
        with the least interference; it is stable between start-ups, and a load that changes between rounds
        cancels in the ratio as long as each T met a quiet moment once."""
        self._mono.pop(n, None)
        t0 = min(rounds[0])
        self.level[n], self.ref[n] = statistics.median(r[t0] for r in rounds), t0
        fastest0 = min(r[t0] for r in rounds)
        for T in rounds[0]:
            self.shape[(n, T)] = min(r[T] for r in rounds) / fastest0
            self.weight[(n, T)] = 1.0

    def cost(self, n: int, T: int) -> float:
        if (n, T) in self.shape and n in self.level:
            return self.level[n] * self._monotone(n)[T]
        if not self.level:
            return float(n * T)
        return self._interp_n(n, T)

    def _monotone(self, n: int) -> dict[int, float]:
        """The shape at n made non-decreasing in T (pool-adjacent-violators, each T weighted by how often live
        forwards refined it): a forward over more tokens does not cost less, and a measurement that says so (a
        noisy start-up on a loaded machine) would otherwise make one K look cheaper than its neighbours."""
        if n in self._mono:
            return self._mono[n]
        ts = sorted(t for (m, t) in self.shape if m == n)
        blocks: list[list] = []                          # [weighted sum, weight, T's] of pooled neighbours
        for t in ts:
            w = self.weight.get((n, t), 1.0)
            blocks.append([self.shape[(n, t)] * w, w, [t]])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                tot, w, members = blocks.pop()
                blocks[-1][0] += tot
                blocks[-1][1] += w
                blocks[-1][2] += members
        self._mono[n] = {t: tot / w for tot, w, members in blocks for t in members}
        return self._mono[n]

    def _at_n(self, n: int, T: int) -> float:
        """Cost at a measured n: nearest measured T, scaled up linearly in T beyond it."""
        ts = [t for (m, t) in self.shape if m == n]
        nearest = min(ts, key=lambda t: abs(t - T))
        c = self.level[n] * self._monotone(n)[nearest]
        return c * T / nearest if T > nearest else c

    def _interp_n(self, n: int, T: int) -> float:
        ns = sorted(self.level)
        lo = max((m for m in ns if m <= n), default=None)
        hi = min((m for m in ns if m >= n), default=None)
        if lo is None:
            return self._at_n(hi, T) * n / hi
        if hi is None:
            return self._at_n(lo, T) * n / lo
        if lo == hi:
            return self._at_n(lo, T)
        w = (n - lo) / (hi - lo)
        return (1 - w) * self._at_n(lo, T) + w * self._at_n(hi, T)
