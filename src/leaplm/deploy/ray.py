"""leaplm on Ray Serve: N replicas, each one leaplm server (engine + batch scheduler + the same FastAPI app and
OpenAI routes as `leaplm serve`), behind Ray Serve's HTTP proxy. Every response carries `x-leaplm-replica`.

  leaplm serve --replicas 2 --backend ray [serve options]     # local Ray, HTTP on --host:--port
  serve run leaplm.deploy.ray:app                             # options from LEAPLM_* environment variables
  serve run leaplm.deploy.ray:app_builder model=... replicas=2  # or as `serve run` arguments

Each replica builds its app in its own process (Ray Serve's ingress builder), loads the engine before it reports
ready, and drains like `leaplm serve`: Ray stops routing to it, waits up to drain_timeout_s for its requests,
then the app's shutdown stops the scheduler. Ray is an optional extra: pip install "leaplm[ray]".
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields

from ..config import ConfigError

log = logging.getLogger(__name__)
INSTALL_HINT = 'pip install "leaplm[ray]"  (or: pip install "ray[serve]")'


@dataclass
class RayServeOptions:
    model: str | None = None
    draft: str | None = None
    method: str | None = None
    k: int = 5
    replicas: int = 2
    cpus_per_replica: float = 1.0
    threads: int = 1                      # torch threads per replica
    max_batch: int = 8
    max_queue: int = 64
    max_model_len: int | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    allowed_hosts: str | None = None      # comma list; None: the loopback names when host is loopback, else any
    kv_cache_bytes: int | None = None     # admission by KV-cache memory, per replica
    adaptive_k: bool = True
    device: str = "cpu"
    draft_device: str | None = None
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= 1024:
            raise ConfigError("replicas", f"must be an integer in [1, 1024], got {self.replicas!r}")
        if not (self.cpus_per_replica > 0):
            raise ConfigError("cpus_per_replica", f"must be > 0, got {self.cpus_per_replica!r}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError("threads", f"must be an integer >= 1, got {self.threads!r}")
        self.server_config()                  # the replicas' server settings, checked here rather than in each

    def server_config(self):
        from ..config import ServerConfig

        return ServerConfig(host=self.host, port=self.port, api_key=self.api_key,
                            served_model_name=self.served_model_name, max_batch=self.max_batch,
                            max_queue=self.max_queue, max_model_len=self.max_model_len,
                            drain_timeout_s=self.drain_timeout_s, allowed_hosts=self.allowed_hosts,
                            kv_cache_bytes=self.kv_cache_bytes)


def require_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ConfigError("replicas", f"Ray Serve is not installed; {INSTALL_HINT}") from None


def _build_replica_app(opts: RayServeOptions):
    """Runs inside each replica: the engine, then leaplm's own app around it, named by the replica."""
    import torch
    from ray import serve

    from ..engine.engine import Engine
    from ..server.app import create_app
    from .replica_header import ReplicaHeader

    torch.set_num_threads(opts.threads)
    engine = Engine(opts.model, draft=opts.draft, method=opts.method, k=opts.k, device=opts.device, dtype=opts.dtype,
                    draft_device=opts.draft_device, max_model_len=opts.max_model_len, adaptive_k=opts.adaptive_k)
    app = create_app(opts.server_config(), engine=engine, model_name=opts.model or "leaplm-embedded", freeze_gc=True)
    ctx = serve.get_replica_context()
    replica = getattr(ctx, "replica_tag", None) or ctx.replica_id.unique_id
    app.add_middleware(ReplicaHeader, replica=str(replica))
    log.info("replica %s ready", replica)
    return app


def build_app(opts: RayServeOptions):
    """The Ray Serve application: one ingress deployment of opts.replicas leaplm servers."""
    require_ray()
    from ray import serve

    def builder():
        return _build_replica_app(opts)

    class LeaplmReplica:
        """One leaplm server; its routes are the app the builder returns."""

    deployment = serve.deployment(
        serve.ingress(builder)(LeaplmReplica), name="leaplm", num_replicas=opts.replicas,
        ray_actor_options={"num_cpus": opts.cpus_per_replica},
        max_ongoing_requests=opts.max_batch + opts.max_queue,
        graceful_shutdown_timeout_s=opts.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5)
    return deployment.bind()


def options_from_mapping(args: dict) -> RayServeOptions:
    """`serve run ... key=value` arguments or LEAPLM_* environment variables -> options (types from the fields)."""
    known = {f.name: str(f.type) for f in fields(RayServeOptions)}
    kw: dict = {}
    for key, raw in args.items():
        if key not in known:
            raise ConfigError(key, f"unknown option; choose from {', '.join(known)}")
        t = known[key]
        try:
            if raw in (None, "") and "None" in t:
                kw[key] = None
            elif t == "bool":
                kw[key] = str(raw).lower() in ("1", "true", "yes")
            elif t.startswith("int"):
                kw[key] = int(raw)
            elif t.startswith("float"):
                kw[key] = float(raw)
            else:
                kw[key] = str(raw)
        except ValueError:
            raise ConfigError(key, f"expected {t.split(' ')[0]}, got {raw!r}") from None
    return RayServeOptions(**kw)


def app_builder(args: dict):
    """`serve run leaplm.deploy.ray:app_builder model=... replicas=2`."""
    return build_app(options_from_mapping(args))


def __getattr__(name: str):
    """`serve run leaplm.deploy.ray:app`: options from LEAPLM_<FIELD> environment variables."""
    if name == "app":
        env = {f.name: os.environ[f"LEAPLM_{f.name.upper()}"] for f in fields(RayServeOptions)
               if f"LEAPLM_{f.name.upper()}" in os.environ}
        return build_app(options_from_mapping(env))
    raise AttributeError(name)


def serve_with_ray(opts: RayServeOptions) -> int:
    """Start a local Ray (loopback), deploy, serve until SIGTERM/SIGINT, then drain and shut down."""
    import signal
    import threading

    require_ray()
    import ray
    from ray import serve

    # A local Ray of its own. The HTTP proxy binds opts.host (loopback by default); Ray's internal services
    # (GCS, raylet, workers) listen on the node's address, which Ray never sets to loopback, and are protected by
    # Ray's cluster token (on by default since Ray 2.5x).
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             num_cpus=max(1, math.ceil(opts.replicas * opts.cpus_per_replica)))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):       # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port})
        serve.run(build_app(opts), name="leaplm", route_prefix="/", blocking=False)
        log.info("leaplm: %d Ray Serve replicas on http://%s:%d", opts.replicas, opts.host, opts.port)
        stop.wait()
        log.info("stopping: draining replicas (up to %.0f s)", opts.drain_timeout_s)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def serve_from_cli(fail, *, replicas: int, backend: str, **options) -> int:
    """`leaplm serve --replicas N --backend ray`: the CLI's checks (fail(message) exits 2), then serve_with_ray."""
    from rich.markup import escape

    _fail = fail
    fail = lambda message: _fail(escape(message))  # noqa: E731 - "leaplm[ray]" is not rich markup
    if backend not in ("local", "ray"):
        fail(f"--backend: choose local or ray, got {backend!r}")
    if backend == "local":
        fail(f"--replicas: {replicas} replicas need --backend ray (the local backend is one process)")
    try:
        opts = RayServeOptions(replicas=replicas, **options)
        require_ray()
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    return serve_with_ray(opts)
