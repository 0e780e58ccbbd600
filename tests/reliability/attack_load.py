"""The load of the hostile-grammar measurement, in a process of its own (python attack_load.py SPEC.json): ordinary
greedy requests from `clients` asyncio clients, and a fourth client, in a process of its own again, that is idle
(calm), sends the hostile bodies one after another (attack), or sends ordinary requests of the same shape in their
place (control). Phases run in rounds, calm / attack / control, then control / attack / calm, and so on, after a
warm-up round (round -1, reported and not to be counted).

Why apart: the latency of an ordinary request is measured by the client that sends it, so that client must not
share a process with anything that stalls it: the server (its steps and compiles want the GIL), the attacker
(building and sending 200 KB bodies), or torch and a model loaded by the test (a full pass of Python's collector
over them is 0.2 s). This script imports neither leaplm nor torch.

A phase starts once the fourth client has taken up its new part (its request of the previous phase answered), and
ends when `requests` ordinary requests that started in it have finished, and, in an attack phase, the fourth client
has sent every hostile body at least once. Only requests sent and answered inside a phase count for it.

With "seconds" in the spec, rounds go on past "rounds" until that many seconds have passed since the first counted
round began (a soak); a round, once begun, is finished.

SPEC.json: {"url", "api_key", "model", "clients", "rounds", "seconds" (default 0), "requests", "warmup" (default true), "ordinary":
[request body, ...], "hostile": [[name, JSON text of the body], ...], "control": JSON text of a body}. Prints one JSON object:
{"phases": [{"round", "kind", "latency_s": [...], "texts": [[prompt, text], ...], "fourth": [[name, status,
error param, error code, seconds], ...]}]}."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import queue
import sys
import time

import httpx

IDLE, ATTACK, CONTROL, STOP = 0, 1, 2, 3
KINDS = {"calm": IDLE, "attack": ATTACK, "control": CONTROL}


def fourth_client(spec: dict, mode, phase, taken, done, results) -> None:
    """Sends what the mode asks for, one request at a time; `taken` is the phase its last request was sent in (or
    that it idles in), `done` the hostile bodies sent in this phase."""
    hostile = [(name, text.encode()) for name, text in spec["hostile"]]
    control = spec["control"].encode()
    headers = {"Authorization": f"Bearer {spec['api_key']}", "Content-Type": "application/json"}
    i = 0
    with httpx.Client(base_url=spec["url"], headers=headers, timeout=300) as h:
        while True:
            with mode.get_lock():
                m, ph = mode.value, phase.value
            if ph != taken.value:
                i, done.value = 0, 0
            taken.value = ph
            if m == STOP:
                return
            if m == IDLE:
                time.sleep(0.005)
                continue
            name, body = hostile[i % len(hostile)] if m == ATTACK else ("control", control)
            t = time.perf_counter()
            r = h.post("/v1/completions", content=body)
            took = time.perf_counter() - t
            err = r.json().get("error") or {} if r.status_code != 200 else {}
            results.put((ph, name, r.status_code, err.get("param"), err.get("code"), took))
            if m == ATTACK:
                i += 1
                done.value = i


async def ordinary_client(h: httpx.AsyncClient, bodies: list[dict], offset: int, log: list, stop: asyncio.Event):
    i = offset
    while not stop.is_set():
        body = bodies[i % len(bodies)]
        i += 1
        t0 = time.monotonic()
        r = await h.post("/v1/completions", json=body)
        t1 = time.monotonic()
        if r.status_code != 200:
            raise RuntimeError(f"an ordinary request got {r.status_code}: {r.text[:500]}")
        log.append((t0, t1, body["prompt"], r.json()["choices"][0]["text"]))


async def run(spec: dict, mode, phase, taken, done) -> list[dict]:
    headers = {"Authorization": f"Bearer {spec['api_key']}"}
    limits = httpx.Limits(max_connections=spec["clients"] + 2)
    log: list = []
    stop = asyncio.Event()
    phases = []
    n_hostile = len(spec["hostile"])
    async with httpx.AsyncClient(base_url=spec["url"], headers=headers, timeout=300, limits=limits) as h:
        clients = [asyncio.create_task(ordinary_client(h, spec["ordinary"], c, log, stop))
                   for c in range(spec["clients"])]
        order = list(KINDS)
        r = -1 if spec.get("warmup", True) else 0      # -1: first uses (caches)
        began = None
        while r < spec["rounds"] or time.monotonic() - began < spec.get("seconds", 0):
            if r == 0:
                began = time.monotonic()
            for kind in order if r % 2 == 0 else order[::-1]:
                with mode.get_lock():
                    mode.value, phase.value = KINDS[kind], len(phases)
                while taken.value != len(phases):      # the fourth client's request of the last phase answered
                    await asyncio.sleep(0.002)
                start = time.monotonic()
                base = len(log)    # what was answered before the phase began: never counted in it (a soak's log is long)
                while True:
                    await asyncio.sleep(0.01)
                    if any(c.done() for c in clients):
                        break
                    counted = sum(1 for t0, *_ in log[base:] if t0 >= start)
                    if counted >= spec["requests"] + spec["clients"] and (kind != "attack" or done.value >= n_hostile):
                        break
                end = time.monotonic()
                mine = [x for x in log[base:] if x[0] >= start and x[1] <= end]
                phases.append({"round": r, "kind": kind, "latency_s": [t1 - t0 for t0, t1, *_ in mine],
                               "texts": [[p, t] for *_, p, t in mine], "fourth": []})
                for c in clients:
                    if c.done():
                        c.result()                     # an ordinary request failed: raise it
            r += 1
        mode.value = STOP
        stop.set()
        await asyncio.gather(*clients)
    return phases


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    ctx = mp.get_context("spawn")
    mode, phase, taken, done = ctx.Value("i", IDLE), ctx.Value("i", -1), ctx.Value("i", -2), ctx.Value("i", 0)
    results = ctx.Queue()
    proc = ctx.Process(target=fourth_client, args=(spec, mode, phase, taken, done, results), daemon=True)
    proc.start()
    try:
        phases = asyncio.run(run(spec, mode, phase, taken, done))
    finally:
        mode.value = STOP
    while True:
        try:
            ph, *rest = results.get(timeout=5 if proc.is_alive() else 0.5)
        except queue.Empty:
            break
        phases[ph]["fourth"].append(rest)
    proc.join(60)
    print(json.dumps({"phases": phases}))


if __name__ == "__main__":
    main()
