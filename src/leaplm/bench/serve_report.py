"""`leaplm bench serve`'s report: percentiles, the summary rows, and the ratios paired by round (speculation on /
off, a backend against the first one's plain decoding, the server against the engine alone)."""
from __future__ import annotations

import statistics

from .serve_config import RequestResult, RunResult

def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile of xs (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def summarize(runs: list[RunResult], servers: dict[str, dict] | None = None) -> list[dict]:
    """One row per (concurrency, backend, speculation, path), in the order the backends were given; `servers` maps a
    --backend entry to what its server reported (ServerProcess.backend_info). With engine runs (--against-engine),
    each server row has `vs_engine`: its requests' median decode rate over the engine's alone on the same requests,
    paired by round."""
    rows = []
    order = list(dict.fromkeys(r.backend for r in runs))
    keys = sorted({(r.concurrency, r.backend, r.speculative, r.path) for r in runs},
                  key=lambda x: (x[0], order.index(x[1]), not x[2], x[3] != "server"))
    for c, b, spec, path in keys:
        rs = [r for r in runs if r.concurrency == c and r.backend == b and r.speculative == spec and r.path == path]
        ok = [x for r in rs for x in r.ok]
        drafted = sum(x.draft_tokens for x in ok)
        info = (servers or {}).get(b, {})
        rows.append({
            "concurrency": c, "backend": info.get("backend", b), "requested_backend": b, "path": path,
            "exactness": info.get("exactness"), "quantization": info.get("quantization"),
            "speculative": spec, "rounds": len(rs),
            "requests": sum(len(r.results) for r in rs), "errors": sum(len(r.results) - len(r.ok) for r in rs),
            "requests_per_s": statistics.median(len(r.ok) / r.wall_s for r in rs),
            "tokens_per_s": statistics.median(sum(x.tokens for x in r.ok) / r.wall_s for r in rs),
            "decode_tokens_per_s_p50": percentile([d for x in ok if (d := decode_rate(x)) is not None], 50),
            "ttft_p50_s": percentile([x.ttft_s for x in ok if x.ttft_s is not None], 50),
            "ttft_p99_s": percentile([x.ttft_s for x in ok if x.ttft_s is not None], 99),
            "itl_p50_s": percentile([t for x in ok for t in x.itl_s], 50),
            "itl_p99_s": percentile([t for x in ok for t in x.itl_s], 99),
            "acceptance_rate": sum(x.accepted_tokens for x in ok) / drafted if drafted else None,
            "k_at_end": [r.k_at_end for r in rs],
            "error_samples": sorted({x.error for r in rs for x in r.results if x.error})[:3],
            "server_path_ms_per_token": server_path_per_token(rs) if path == "server" else None,
        })
    served = [r for r in runs if r.path == "server"]
    for r in rows:
        b = r["requested_backend"]
        r["vs_engine"] = (paired_decode_ratio(runs, r["concurrency"], b, r["speculative"])
                          if r["path"] == "server" else None)
        if r["path"] != "server":
            r["speedup_vs_none"] = r["vs_first_backend_none"] = None
            continue
        r["speedup_vs_none"] = paired_speedup(served, r["concurrency"], b) if r["speculative"] else 1.0
        r["vs_first_backend_none"] = (paired_ratio(served, r["concurrency"], (b, r["speculative"]),
                                                   (order[0], False)) if len(order) > 1 else None)
    return rows


def decode_rate(x: RequestResult) -> float | None:
    """A request's decode rate: tokens after its first over the time from its first token to its last."""
    gap = sum(x.itl_s)
    return len(x.itl_s) / gap if x.itl_s and gap > 0 else None


def median_decode(run: RunResult) -> float | None:
    rates = [d for x in run.ok if (d := decode_rate(x)) is not None]
    return statistics.median(rates) if rates else None


def paired_decode_ratio(runs: list[RunResult], concurrency: int, backend: str, speculative: bool) -> float | None:
    """Median over rounds of the server's median per-request decode rate / the engine's alone, same round."""
    ratios = []
    for rnd in sorted({r.round for r in runs if r.concurrency == concurrency}):
        pair = {r.path: r for r in runs if (r.concurrency, r.backend, r.speculative, r.round)
                == (concurrency, backend, speculative, rnd)}
        if "server" in pair and "engine" in pair:
            a, b = median_decode(pair["server"]), median_decode(pair["engine"])
            if a and b:
                ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def tokens_per_s(run: RunResult) -> float:
    return sum(x.tokens for x in run.ok) / run.wall_s


def paired_ratio(runs: list[RunResult], concurrency: int, a: tuple[str, bool], b: tuple[str, bool]) -> float | None:
    """Median over rounds of tokens/s of configuration a / configuration b (each a (backend, speculative) pair)
    in the same round: a round's runs are adjacent in time, so slow changes in the machine's load cancel out of
    each ratio."""
    ratios = []
    for rnd in sorted({r.round for r in runs if r.concurrency == concurrency}):
        pair = {(r.backend, r.speculative): r for r in runs if r.concurrency == concurrency and r.round == rnd}
        if a in pair and b in pair and tokens_per_s(pair[b]) > 0:
            ratios.append(tokens_per_s(pair[a]) / tokens_per_s(pair[b]))
    return statistics.median(ratios) if ratios else None


def paired_speedup(runs: list[RunResult], concurrency: int, backend: str | None = None) -> float | None:
    """Speculation on / off on one backend's server (the only one when None), paired by round."""
    backend = backend if backend is not None else next((r.backend for r in runs), "auto")
    return paired_ratio(runs, concurrency, (backend, True), (backend, False))


def server_path_per_token(runs: list[RunResult]) -> dict | None:
    """Where a generated token's time went in the server over these runs, as the server counted it (server/metrics.py
    StreamTimes): milliseconds per token of its steps (engine_step), of the event loop's wake-ups after them
    (wakeup), of building stream chunks (serialize) and of writing them (write), and wake-ups and writes per token.
    The loop's work runs beside the next step's forward (which runs without the GIL), so the stages are not a sum
    of the token's latency: each is CPU (or waiting) the token cost that stage."""
    deltas = [r.server_path for r in runs if r.server_path is not None]
    if not deltas:
        return None
    total = {k: sum(d[k] for d in deltas) for k in deltas[0]}
    tokens = total["tokens"]
    if tokens <= 0:
        return None
    out = {"engine_step": 1000 * total["engine_step_s"] / tokens}
    for stage in ("wakeup", "serialize", "write"):
        out[stage] = 1000 * total[stage + "_s"] / tokens
    out["tokens_per_step"] = tokens / total["steps"] if total["steps"] else None
    out["wakeups_per_token"] = total["wakeup_n"] / tokens
    out["writes_per_token"] = total["write_n"] / tokens
    return out
