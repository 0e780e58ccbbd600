"""Sampling by position: a sampled request's tokens depend on (seed, position) and the distributions alone.

Speculative decoding with rejection sampling consumes a varying number of random draws per step, and even with
draws fixed per position its output depends on K: a token that was drafted is accepted or replaced by a residual
sample, one that was not is sampled from p, and these are different functions of the same random numbers. With
an adaptive K (chosen from measured timings and from what else is in the batch) a seed would not reproduce.

So sampled requests use the exponential race (the Gumbel-max trick): every position t (an index into the
request's tokens, prompt included) owns a vector of exponentials E_t [V], fixed by (seed, t), and the token at t
is argmax_x p_t(x) / E_t(x), an exact sample from p_t. A proposer samples its draft token at t from q_t with the
same E_t (argmax q_t / E_t, an exact sample from q_t), and verification accepts a draft token exactly when it
equals the target's own sample at its position (verify/coupled.py). The output is then, token for token, what
sampling from the target alone with these exponentials gives: lossless, and the same whatever K each step chose,
whatever the proposer and whatever else was in the batch. Drafts that were discarded used exponentials of
positions whose tokens are decided later by the target's own sample, so nothing kept depends on them.

Acceptance is P(argmax q/E == argmax p/E), at least (1 - TV) / (1 + TV) (drafter-invariant speculative decoding,
Daliri et al. 2024) where rejection sampling gets 1 - TV; for a deterministic proposer (q one-hot at x) both are
p(x).

The exponentials come from a counter-based hash (SplitMix64's finaliser over seed, position and token id, all 64
bits of the seed used), vectorised over the vocabulary in uint64 arithmetic (numpy on the CPU, int64 torch
elsewhere: the same bits).
"""
from __future__ import annotations

import numpy as np
import torch

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_POS = 0xD1B54A32D192ED03
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit unsigned constant as the int64 torch stores (multiplication wraps modulo 2^64 either way)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (a bijection of 64-bit integers with good avalanche)."""
    x = (x ^ (x >> 30)) * _M1 & MASK64
    x = (x ^ (x >> 27)) * _M2 & MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 x (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """_mix64 over an int64 tensor (two's complement: the same bits)."""
    x = (x ^ _srl(x, 30)) * _signed(_M1)
    x = (x ^ _srl(x, 27)) * _signed(_M2)
    return x ^ _srl(x, 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of (seed, position); seed taken modulo 2^64."""
    return _mix64((_mix64((seed & MASK64) ^ _GOLDEN) + position * _POS) & MASK64)


def exponentials(seed: int, positions: list[int], vocab: int, device=None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """E [len(positions), vocab] float64: iid Exp(1) per (position, token), fixed by the seed. ids [N] long: only
    those tokens' columns -> [len(positions), N] (the same values, for drafts over a reduced vocabulary)."""
    if device is None or torch.device(device).type == "cpu":
        u = torch.from_numpy(_uniforms_np(seed, positions, vocab, ids))                   # [N, V] in (0, 1)
    else:
        u = _uniforms_torch(seed, positions, vocab, device, ids)
    return -torch.log(u)


def _uniforms_torch(seed: int, positions: list[int], vocab: int, device, ids: torch.Tensor | None) -> torch.Tensor:
    """The uniforms behind exponentials() in int64 torch arithmetic (any device) -> [N, V] float64."""
    keys = torch.tensor([_signed(position_key(seed, t)) for t in positions], dtype=torch.int64, device=device)
    tok = torch.arange(vocab, dtype=torch.int64, device=device) if ids is None else ids.to(device, torch.int64)
    ids = tok * _signed(_GOLDEN)
    h = _mix64_t(keys.view(-1, 1) + ids.view(1, -1))                                  # [N, V] int64
    return (_srl(h, 11).double() + 0.5) * (1.0 / (1 << 53))


_TOKEN_TERMS: dict[int, np.ndarray] = {}


def _token_terms(vocab: int) -> np.ndarray:
    """token id * golden ratio constant, mod 2^64, for every id below vocab (cached: the same every step)."""
    t = _TOKEN_TERMS.get(vocab)
    if t is None:
        t = _TOKEN_TERMS[vocab] = np.arange(vocab, dtype=np.uint64) * np.uint64(_GOLDEN)
    return t


def _uniforms_np(seed: int, positions: list[int], vocab: int, ids: torch.Tensor | None) -> np.ndarray:
    """The same uniforms as _uniforms_torch, bit for bit, on the CPU: numpy's uint64 arithmetic wraps and shifts
    logically, so SplitMix64 takes 10 in-place passes instead of torch's 17 allocating ones (a sampled position over
    a 49k vocabulary costs about a third)."""
    keys = np.array([position_key(seed, t) for t in positions], dtype=np.uint64)       # [N]
    tok = _token_terms(vocab) if ids is None else ids.cpu().numpy().astype(np.uint64) * np.uint64(_GOLDEN)
    x = keys[:, None] + tok[None, :]                                                     # [N, V] uint64
    t = np.empty_like(x)
    np.right_shift(x, np.uint64(30), out=t)
    x ^= t
    x *= np.uint64(_M1)
    np.right_shift(x, np.uint64(27), out=t)
    x ^= t
    x *= np.uint64(_M2)
    np.right_shift(x, np.uint64(31), out=t)
    x ^= t
    x >>= np.uint64(11)
    u = x.astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    return u


def race(probs: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """The token each row of probs [N, V] samples at its position: argmax p / E -> [N] long. A token of
    probability 0 is never chosen (a row with no mass at all is refused)."""
    e = exponentials(seed, positions, probs.shape[-1], probs.device)                  # [N, V]
    score = probs.double() / e
    if not bool((probs > 0).any(-1).all()):
        raise ValueError("cannot sample from a distribution with no mass")
    return score.argmax(-1)


def ranked(probs: torch.Tensor, seed: int, position: int, n: int, ids: torch.Tensor | None = None) -> list[int]:
    """The n best tokens of probs [V] at `position` by p / E: the first is race's sample; the others are
    distinct further candidates (for tree proposers), tokens of probability 0 excluded. With ids [N], probs [N]
    holds the probabilities of tokens ids (0 elsewhere) and the indices returned are into ids: the same tokens
    as ranking the full row, without building it."""
    e = exponentials(seed, [position], probs.numel(), probs.device, ids)[0]                # [V] or [N]
    score = probs.double().reshape(-1) / e
    n = min(n, int((probs > 0).sum()))
    return score.topk(n).indices.tolist()


def fold_seed(seed: int) -> int:
    """A 64-bit seed hashed down to the 32 bits torch.Generator honours (for proposers drawing sequentially)."""
    h = _mix64(seed & MASK64)
    return (h ^ (h >> 32)) & 0xFFFFFFFF


SEED_RANGE = (-(1 << 63), 1 << 64)


def check_seed(seed: int) -> int:
    """A seed as the 64-bit integer the draws use: [0, 2^64) as is, [-2^63, 0) as its two's complement."""
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"must be in [-2^63, 2^64), got {seed}")
    return seed & MASK64
