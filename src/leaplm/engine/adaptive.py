"""Adaptive K: choose each step's K from measured costs and measured acceptance, down to 0 (no speculation)
when speculating would be slower than plain decoding.

Expected tokens per step with per-token acceptance a and K drafted: (1 - a^(K+1)) / (1 - a) (the bonus or
recovered token included). Cost per step: target_cost(K + 1) + K * propose_cost. K maximises tokens / cost.
Target costs per block length are measured at engine start (calibration) and refreshed from live steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class CostModel:
    """Seconds per target forward over T tokens, T = 1..k_max+1 (EMA of measurements)."""
    target_s: dict[int, float] = field(default_factory=dict)
    decay: float = 0.9
    propose_s_per_token: float = 0.0    # calibrated proposer cost (draft models), the controllers' prior

    def observe(self, T: int, seconds: float) -> None:
        old = self.target_s.get(T)
        self.target_s[T] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def cost(self, T: int) -> float:
        if T in self.target_s:
            return self.target_s[T]
        known = sorted(self.target_s)
        if not known:
            return 1.0
        nearest = min(known, key=lambda t: abs(t - T))
        return self.target_s[nearest] * max(1.0, T / nearest) if T > nearest else self.target_s[nearest]


@dataclass
class AdaptiveK:
    k_max: int
    costs: CostModel
    enabled: bool = True
    accepted: float = 4.0         # EMA-weighted counts: prior acceptance 0.8
    rejected: float = 1.0
    propose_s_per_token: float = 0.0
    probe_every: int = 8          # at K = 0, still propose this often to keep measuring acceptance; the
    max_probe_every: int = 128    # interval doubles while probes keep saying K = 0 (a probe also pays the
    _since_probe: int = 0         # proposer's catch-up on the tokens it skipped)
    _interval: int = 0
    extra_tokens: float = 0.0     # EMA of tokens a proposal adds to the forward beyond its K (lookahead's window)
    decay: float = 0.9

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        if not self.enabled:
            return self.k_max
        a = self.acceptance
        best_k, best = 0, 1.0 / self.costs.cost(1)
        extra = round(self.extra_tokens)
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(a, k) / (self.costs.cost(k + 1 + extra) + k * self.propose_s_per_token)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0:
            if not self._could_pay():
                return 0                 # not even perfect acceptance beats plain decoding: never probe
            self._interval = self._interval or self.probe_every
            self._since_probe += 1
            if self._since_probe >= self._interval:
                self._since_probe = 0
                self._interval = min(2 * self._interval, self.max_probe_every)
                return 1
        else:
            self._interval = 0
        return best_k

    def _could_pay(self) -> bool:
        plain = 1.0 / self.costs.cost(1)
        extra = round(self.extra_tokens)
        return any(expected_tokens(1.0, k) / (self.costs.cost(k + 1 + extra) + k * self.propose_s_per_token)
                   > plain for k in range(1, self.k_max + 1))

    def observe(self, drafted: int, accepted: int, propose_s: float, score_s: float,
                scored: int | None = None) -> None:
        """scored: tokens in the target forward when more than drafted + 1 (a tree proposal's extra tokens)."""
        self.costs.observe(scored or drafted + 1, score_s)
        if drafted == 0:
            return
        d = self.decay
        extra = max(0, (scored or drafted + 1) - drafted - 1)
        self.extra_tokens = extra if self.extra_tokens == 0 else d * self.extra_tokens + (1 - d) * extra
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (1 if accepted < drafted else 0)
        per = propose_s / drafted
        self.propose_s_per_token = per if self.propose_s_per_token == 0 else d * self.propose_s_per_token + (1 - d) * per


# --- many requests: one K per batched step ---------------------------------------------------------------------
# With n rows verified in one forward of n x (K + 1) tokens, the step's K maximises the batch's token rate
#   sum_i E[tokens_i](a_i, min(K, cap_i)) / (cost(n, K + 1) + sum_i [min(K, cap_i) * propose_s_i + catchup_i])
# where cap_i is row i's own K (0 for a row that does not speculate) and catchup_i (only for rows that draft) is a
# draft model's prefill of unseen tokens spread over the request's remaining steps; K > 0 must beat K = 0 by
# min_gain. cost(n, T) is the measured time of a
# batched forward; as n grows the forward turns compute-bound, cost(n, K + 1) outgrows the tokens it buys and
# K falls to 0: speculation never makes a full batch slower than plain decoding.


@dataclass
class BatchCostModel:
    """Seconds per batched target forward over n rows of T tokens (EMA per measured (n, T), interpolated)."""
    table: dict[tuple[int, int], float] = field(default_factory=dict)
    decay: float = 0.9

    def observe(self, n: int, T: int, seconds: float) -> None:
        old = self.table.get((n, T))
        self.table[(n, T)] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def cost(self, n: int, T: int) -> float:
        if (n, T) in self.table:
            return self.table[(n, T)]
        if not self.table:
            return float(n * T)
        return self._interp_n(n, T)

    def _at_n(self, n: int, T: int) -> float:
        """Cost at a measured n: nearest measured T, scaled up linearly in T beyond it."""
        ts = [t for (m, t) in self.table if m == n]
        nearest = min(ts, key=lambda t: abs(t - T))
        c = self.table[(n, nearest)]
        return c * T / nearest if T > nearest else c

    def _interp_n(self, n: int, T: int) -> float:
        ns = sorted({m for (m, _) in self.table})
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


@dataclass
class AcceptanceEstimate:
    """One request's per-token acceptance, EMA-weighted counts (prior 0.8, as AdaptiveK)."""
    accepted: float = 4.0
    rejected: float = 1.0
    decay: float = 0.9

    @classmethod
    def seeded(cls, rate: float, strength: float = 5.0) -> "AcceptanceEstimate":
        """A new request's estimate, starting from what its method has measured on earlier requests (worth
        `strength` drafts) instead of the fixed prior: a full batch keeps admitting new rows, and an optimistic
        prior on each would keep buying drafts that the measured acceptance does not pay for."""
        return cls(accepted=strength * rate, rejected=strength * (1 - rate))

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)


@dataclass
class RowSpec:
    """What the batch controller needs to know about one running row."""
    cap: int                       # this row's own K (0: the row does not speculate)
    acceptance: float              # per-token acceptance estimate
    propose_s_per_token: float     # measured proposer seconds per drafted token
    catchup_s: float = 0.0         # a draft model's prefill of tokens it has not seen, spread over the request's
                                   # remaining steps (paid once, then drafting is cheap): charged when it drafts


@dataclass
class BatchAdaptiveK:
    """Chooses the K of each batched step from measured forward costs and per-row acceptance (see above)."""
    costs: BatchCostModel
    enabled: bool = True
    probe_every: int = 8           # at K = 0 chosen for low acceptance, draft 1 token every probe_every * n steps
    # A batch drafts only when the model predicts at least this gain over K = 0: near the break-even point (a
    # filling batch) the prediction rests on costs measured at other contexts and loads, and a wrong call there
    # makes the server slower than plain decoding; a small margin buys "never slower" for little.
    min_gain: float = 0.05
    _since_probe: int = 0

    def rate(self, rows: list[RowSpec], K: int) -> float:
        """Expected tokens per second of a step with K over these rows."""
        n = len(rows)
        tokens = sum(expected_tokens(r.acceptance, min(K, r.cap)) for r in rows)
        seconds = self.costs.cost(n, K + 1) + sum(min(K, r.cap) * r.propose_s_per_token
                                                  + (r.catchup_s if min(K, r.cap) else 0.0) for r in rows)
        return tokens / seconds

    def best(self, rows: list[RowSpec]) -> int:
        k_max = max((r.cap for r in rows), default=0)
        plain = self.rate(rows, 0)
        best_k, best = 0, plain * (1 + self.min_gain)
        for K in range(1, k_max + 1):
            r = self.rate(rows, K)
            if r > best:
                best_k, best = K, r
        return best_k

    def choose(self, rows: list[RowSpec]) -> int:
        k_max = max((r.cap for r in rows), default=0)
        if k_max == 0:
            return 0
        if not self.enabled:
            return k_max
        K = self.best(rows)
        if K == 0:
            # Probe only when acceptance is what keeps K at 0: if even perfect acceptance would not pay at this
            # batch size, drafting a token would only cost.
            perfect = [RowSpec(r.cap, 1.0, r.propose_s_per_token, r.catchup_s) for r in rows]
            # A probe widens every row's block, so with n rows it comes n times less often.
            if self.best(perfect) > 0:
                self._since_probe += 1
                if self._since_probe >= self.probe_every * len(rows):
                    self._since_probe = 0
                    return 1
        return K
