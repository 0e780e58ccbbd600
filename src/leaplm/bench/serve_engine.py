"""`leaplm bench serve --against-engine`: the baseline of the same requests through the engine alone, in the
benchmark's process (its continuous-batching scheduler; no HTTP, asyncio or serialization)."""
from __future__ import annotations

import time

from .serve_config import PROMPTS, LoadBenchConfig, RequestResult

class EngineAlone:
    """--against-engine: the server's requests through the engine alone, in this process: an Engine built with the
    server's options, its continuous-batching scheduler (max_batch rows, its own thread), `concurrency` requests in
    flight. Each request is timed as the client times a streamed one, at the moment each step's tokens come back:
    the same decode rate with no HTTP, asyncio or serialization in between."""

    def __init__(self, cfg: LoadBenchConfig, model: str | None, draft: str | None):
        from ..config import EngineConfig
        from ..engine.engine import Engine
        from ..engine.scheduler import BatchScheduler

        backend = cfg.backends[0]
        self.engine = Engine(config=EngineConfig(
            model, draft, cfg.method, cfg.k, backend=backend, device=cfg.device, dtype=cfg.dtype,
            quantization=cfg.quantization if backend != "llamacpp" else None, kv_cache_dtype=cfg.kv_cache_dtype,
            threads=cfg.threads, max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
            spec_options={"adaptive_k": not cfg.fixed_k}))
        self.backend = backend
        # calibrated as the server's (its K policy's costs), except where no request drafts
        self.scheduler = BatchScheduler(self.engine, max_batch=cfg.max_batch, max_queue=max(64, 2 * cfg.max_batch),
                                        calibrate=cfg.method != "none")
        self.scheduler.start()

    def run(self, concurrency: int, n_requests: int, speculative: bool, cfg: LoadBenchConfig,
            offset: int) -> tuple[float, list[RequestResult]]:
        import threading

        from ..config import SamplingParams
        from ..engine.scheduler import SeqRequest

        params = SamplingParams(max_new_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
        prompts = [self.engine.encode(PROMPTS[(offset + i) % len(PROMPTS)], params) for i in range(n_requests)]
        results: list[RequestResult] = []
        done = threading.Semaphore(0)

        def request(ids: list[int]) -> SeqRequest:
            res = RequestResult(ok=False)
            t0 = time.perf_counter()
            last: list[float | None] = [None]

            def on_output(out) -> None:               # the scheduler's thread, once per step
                now = time.perf_counter()
                n = len(out.chunk.token_ids) if out.chunk is not None else 0
                if n:
                    if last[0] is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.extend([(now - last[0]) / n] * n)
                    last[0] = now
                    res.tokens += n
                if out.error is not None:
                    res.error = out.error
                if out.finished:
                    res.ok = out.error is None
                    st = out.chunk.stats if out.chunk is not None else None
                    if st is not None:
                        res.draft_tokens, res.accepted_tokens = st.draft_tokens, st.accepted_tokens
                    res.e2e_s = now - t0
                    results.append(res)
                    done.release()

            return SeqRequest(ids, params, on_output, method=None if speculative else "none")

        t0 = time.perf_counter()
        pending = list(prompts)
        for _ in range(min(concurrency, len(pending))):
            self.scheduler.submit([request(pending.pop(0))])
        for _ in range(n_requests):
            if not done.acquire(timeout=cfg.timeout_s):
                raise TimeoutError(f"the engine alone did not finish a request in {cfg.timeout_s} s")
            if pending:
                self.scheduler.submit([request(pending.pop(0))])
        return time.perf_counter() - t0, results

    def stop(self) -> None:
        self.scheduler.stop()
