"""libllama through llama-cpp-python: loaded once, its backend initialized, its log routed to `logging`; the last
log lines kept for error messages (`recent_log`)."""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from collections import deque

from ...config import ConfigError

log = logging.getLogger(__name__)

EXTRA = "llamacpp"
INSTALL = f'pip install "leaplm[{EXTRA}]"'
LOG_LEVELS = {1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG}


def available() -> bool:
    """Whether llama-cpp-python (the `llamacpp` extra) is installed, without loading libllama."""
    return importlib.util.find_spec("llama_cpp") is not None


_lib = None
_lib_lock = threading.Lock()
_log_lines: deque[str] = deque(maxlen=40)      # libllama's recent log lines, for error messages
_log_count = [0]                               # lines logged so far
_log_callback = None                           # kept referenced: libllama calls it


def libllama(field: str = "backend"):
    """The llama_cpp module with its backend initialized and its log routed to `logging`; ConfigError naming the
    extra when it is not installed."""
    global _lib, _log_callback
    with _lib_lock:
        if _lib is not None:
            return _lib
        try:
            import llama_cpp as lc
        except ImportError as e:
            raise ConfigError(field, f"the llama.cpp backend needs llama-cpp-python, the '{EXTRA}' extra "
                                     f"({INSTALL}); it is not importable here ({e}). --backend torch runs GGUF "
                                     "files on leaplm's own kernels") from None
        last = [logging.INFO]

        @lc.llama_log_callback
        def _cb(level: int, text: bytes, user_data) -> None:
            lvl = last[0] if level == 5 else LOG_LEVELS.get(level, logging.DEBUG)
            last[0] = lvl
            line = text.decode("utf-8", "replace").rstrip("\n")
            if line:
                _log_lines.append(line)
                _log_count[0] += 1
                log.debug("libllama: %s", line)

        _log_callback = _cb
        lc.llama_log_set(_cb, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _lib = lc
        return lc




def log_count() -> int:
    """libllama's log lines so far (a mark for recent_log)."""
    return _log_count[0]


def recent_log(since: int) -> str:
    """libllama's log lines since the count `since` (the last few), joined."""
    n = min(6, _log_count[0] - since, len(_log_lines))
    return " | ".join(line.strip() for line in list(_log_lines)[len(_log_lines) - n:]) if n > 0 else ""


def check_file(path: str, field: str = "model") -> None:
    """ConfigError with libllama's reason when it cannot load the GGUF file at `path` (its vocabulary and
    metadata are read, not its weights)."""
    lc = libllama(field)
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    seen = log_count()
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ConfigError(field, f"{path}: libllama cannot load this file ({recent_log(seen) or 'no reason given'})")
    lc.llama_model_free(model)

