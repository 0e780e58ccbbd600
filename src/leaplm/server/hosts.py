"""The Host header check (DNS rebinding): a web page on attacker.example whose name resolves to 127.0.0.1 can
make the victim's browser talk to a loopback server, but the browser still sends `Host: attacker.example`.
Answering only the names the server is meant to be reached by closes that door."""
from __future__ import annotations

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1", "[::1]")


def default_allowed_hosts(bind: str) -> tuple[str, ...] | None:
    """The loopback names when bound to loopback; None (no check) otherwise."""
    return LOOPBACK_NAMES if bind.lower() in LOOPBACK_BINDS or bind.startswith("127.") else None


def host_name(header: str) -> str:
    """The name part of a Host header value, lower-cased, without port or IPv6 brackets."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def allowed(header: str | None, names: tuple[str, ...] | None) -> bool:
    if names is None or "*" in names:
        return True
    if not header:
        return False
    return host_name(header) in {host_name(n) if n.startswith("[") else n.lower() for n in names}
