"""Adaptive K, the one K policy: choose each step's K from measured costs and measured acceptance, down to 0
(no speculation) when speculating would be slower than plain decoding. A single request is a batch of one.

Expected tokens per step with per-token acceptance a and K drafted: (1 - a^(K+1)) / (1 - a) (the bonus or
recovered token included). Target costs per (rows, block length) are measured once per engine (step.calibrate)
and refreshed from live steps; they live, with proposer costs and per-method acceptance, in `Estimates`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


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
    """One request's acceptance, EMA-weighted counts: a per-token rate (prior 0.8) and, per draft position i, how
    often a step that asked for at least i + 1 tokens had its first i + 1 accepted. The second gives the expected
    tokens of a step at each K directly, which matters for bursty proposers (an n-gram match is often right all
    the way or not at all, so per-token acceptance undersells long drafts), and it counts the steps where the
    proposer found nothing to draft."""
    accepted: float = 4.0
    rejected: float = 1.0
    decay: float = 0.9
    asked: list[float] = field(default_factory=list)     # [K] EMA weight of steps that asked for >= i + 1 tokens
    passed: list[float] = field(default_factory=list)    # [K] of those, steps whose first i + 1 were accepted
    min_weight: float = 2.0                              # below this a position falls back to extrapolation

    @classmethod
    def seeded(cls, rate: float, strength: float = 5.0) -> "AcceptanceEstimate":
        """A new request's estimate, starting from what its method has measured on earlier requests (worth
        `strength` drafts) instead of the fixed prior: a full batch keeps admitting new rows, and an optimistic
        prior on each would keep buying drafts that the measured acceptance does not pay for."""
        return cls(accepted=strength * rate, rejected=strength * (1 - rate))

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, drafted: int, accepted: int, asked: int | None = None) -> None:
        """A step asked for `asked` tokens (default: drafted), the proposer drafted `drafted`, `accepted` kept."""
        asked = drafted if asked is None else asked
        if asked > 0:
            grow = asked - len(self.asked)
            if grow > 0:
                self.asked += [0.0] * grow
                self.passed += [0.0] * grow
            d = self.decay
            self.asked = [d * w + (1.0 if i < asked else 0.0) for i, w in enumerate(self.asked)]
            self.passed = [d * w + (1.0 if i < accepted else 0.0) for i, w in enumerate(self.passed)]
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)

    def tokens_by_k(self, cap: int) -> list[float]:
        """Expected tokens of a step asking for k = 0..cap drafts (1 at k = 0): 1 + sum over i < k of P(first
        i + 1 accepted), measured where enough steps asked that far, else extrapolated from the last measured
        position with the per-token rate."""
        out, total, prob, a = [1.0], 1.0, 1.0, self.rate
        for i in range(cap):
            if i < len(self.asked) and self.asked[i] >= self.min_weight:
                prob = min(prob, self.passed[i] / self.asked[i])
            else:
                prob *= a
            total += prob
            out.append(total)
        return out


@dataclass
class RowSpec:
    """What the batch controller needs to know about one running row."""
    cap: int                       # this row's own K (0: the row does not speculate)
    acceptance: float              # per-token acceptance estimate
    propose_s_per_token: float     # measured proposer seconds per drafted token
    catchup_s: float = 0.0         # a draft model's prefill of tokens it has not seen, spread over the request's
                                   # remaining steps (paid once, then drafting is cheap): charged when it drafts
    extra_tokens: float = 0.0      # tokens its proposals add to the forward beyond K (lookahead's window)
    tokens_by_k: list[float] | None = None   # [cap + 1] expected tokens at each K (else the per-token formula)

    def expected(self, k: int) -> float:
        if self.tokens_by_k is not None and k < len(self.tokens_by_k):
            return self.tokens_by_k[k]
        return expected_tokens(self.acceptance, k)


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
        tokens = sum(r.expected(min(K, r.cap)) for r in rows)
        extra = round(max((r.extra_tokens for r in rows if min(K, r.cap)), default=0.0))
        seconds = self.costs.cost(n, K + 1 + extra) + sum(min(K, r.cap) * r.propose_s_per_token
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
            perfect = [RowSpec(r.cap, 1.0, r.propose_s_per_token, r.catchup_s, r.extra_tokens) for r in rows]
            # A probe widens every row's block, so with n rows it comes n times less often.
            if self.best(perfect) > 0:
                self._since_probe += 1
                if self._since_probe >= self.probe_every * len(rows):
                    self._since_probe = 0
                    return 1
        return K


def rows_bucket(n: int) -> int:
    """n rounded up to a power of two (costs measured at 5 rows stand for 5..8)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class Estimates:
    """What an engine has measured, shared by every batch it runs (the one cost calibration): batched forward
    costs, proposer seconds per drafted token and acceptance per method, a draft model's prefill cost."""
    costs: BatchCostModel = field(default_factory=BatchCostModel)
    propose_s: dict[str, float] = field(default_factory=dict)       # method -> EMA of seconds per drafted token
    # (method, rows bucket) -> the same, for proposers that draft for many rows at once (the draft model): its
    # forward over n rows costs far less than n forwards, so its cost per drafted token depends on n
    propose_s_rows: dict[tuple[str, int], float] = field(default_factory=dict)
    # method -> acceptance over all its requests (slow EMA): the starting estimate of a new request's row
    method_acceptance: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    draft_prefill_s_per_token: float = 0.0
    calibrated_rows: set[int] = field(default_factory=set)          # batch sizes step.calibrate has measured

    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        """rows: how many rows drafted together (None: a proposer that drafts row by row)."""
        old = self.propose_s.get(method)
        self.propose_s[method] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token
        if rows is not None:
            key = (method, rows_bucket(rows))
            old = self.propose_s_rows.get(key)
            self.propose_s_rows[key] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token

    def propose_cost(self, method: str, rows: int) -> float:
        """Seconds per drafted token of `method` when `rows` rows draft in one step."""
        by_rows = self.propose_s_rows.get((method, rows_bucket(rows)))
        return by_rows if by_rows is not None else self.propose_s.get(method, 0.0)

    def observe_acceptance(self, method: str, drafted: int, accepted: int) -> None:
        self.method_acceptance.setdefault(method, AcceptanceEstimate(decay=0.98)).observe(drafted, accepted)
