"""Running the server: uvicorn with leaplm's drain on SIGTERM/SIGINT (`leaplm serve` calls run_server)."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from ..config import ServerConfig

log = logging.getLogger(__name__)


def run_server(config: ServerConfig, load, model_name: str) -> int:
    """Run uvicorn with leaplm's drain on SIGTERM/SIGINT until it exits; returns the process exit code."""
    from .app import create_app
    from .http_protocol import uvicorn_config

    holder: dict = {}

    def on_load_error(message: str) -> None:
        holder["failed"] = message
        srv = holder.get("server")
        if srv is not None:
            srv.should_exit = True

    app = create_app(config, load=load, model_name=model_name, on_load_error=on_load_error, freeze_gc=True)
    ucfg = uvicorn_config(app, config)
    server = DrainingServer(ucfg, app.state.leaplm, config.drain_timeout_s)
    holder["server"] = server
    log.info("leaplm serving %s on http://%s:%d", app.state.leaplm.model_name, config.host, config.port)
    server.run()
    if "failed" in holder:
        log.error("%s", holder["failed"])
        return 2 if app.state.leaplm.load_error_is_input else 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn, with leaplm's shutdown on SIGTERM/SIGINT:

    1st signal  drain: new requests get 503, /health 503, running ones finish (up to the drain timeout), exit 0.
    2nd signal  stop now, cleanly: every running and waiting sequence is aborted, so each client gets an error
                event and [DONE] (or a JSON 503), then the server exits 0.
    3rd signal  exit without waiting for connections (uvicorn's force exit).

    Whatever the path, the scheduler thread is stopped before serve() returns: a thread still inside a torch
    kernel while the interpreter shuts down aborts the process (SIGABRT, exit 134)."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            sched = self.state.scheduler
            if sched is not None:
                await asyncio.to_thread(sched.stop)

    def handle_exit(self, sig, frame):
        self._signals += 1
        if self._loop is None:
            self.should_exit = True
            return
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if self._signals == 1:
            log.info("signal %s: draining (up to %.0f s)", name, self.drain_timeout)
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))
        elif self._signals == 2:
            log.info("signal %s again: aborting what is running and stopping", name)
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.stop_now()))
        else:
            self.should_exit = self.force_exit = True

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        sched = state.scheduler
        if sched is not None:
            sched.close_admission()
            deadline = time.monotonic() + self.drain_timeout
            while not sched.idle and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(0.05)
            if not sched.idle:
                log.warning("drain timeout: aborting %d running and %d waiting requests", sched.running,
                            sched.queue_depth)
                await self._abort_all("the server is shutting down (drain timeout)")
        await asyncio.sleep(0.1)            # let handlers write their last bytes
        self.should_exit = True

    async def stop_now(self) -> None:
        self.state.draining = True
        if self.state.scheduler is not None:
            self.state.scheduler.close_admission()
            await self._abort_all("the server is shutting down (second signal)")
        await asyncio.sleep(0.1)
        self.should_exit = True

    async def _abort_all(self, reason: str) -> None:
        sched = self.state.scheduler
        sched.abort_all(reason)
        for _ in range(100):
            if sched.idle:
                break
            await asyncio.sleep(0.02)
