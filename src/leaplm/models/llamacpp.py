"""GGUF models on llama.cpp's kernels: libllama through llama-cpp-python's low-level API, behind models/base.py.

The weights stay as the file stores them (every type llama.cpp computes on, K-quants and IQ included); leaplm's
engine drives the forwards. One `LlamaCppCache` is one llama.cpp context:

  rows      where llama.cpp is batch-invariant for the file (LlamaCppLM.batch_invariant), each row of a batch
            has a context of its own (LlamaCppRows): a row's KV cells then depend on its own tokens alone. In one
            shared context, rows that finish or roll back free cells that other rows refill, so a row's cells stop
            being in position order, and llama.cpp's attention (flash attention visits cells in cell order; the
            non-flash kernels reduce in SIMD lanes by cell index) rounds differently than for the same request
            alone: greedy near-ties flip under concurrency. A forward over [B, T] tokens is then B `llama_decode`s.
            Where llama.cpp is not batch-invariant anyway (F32, F16, repacked K-quants), rows are sequences
            b of one context (n_seq_max = rows + TREE_SEQS, a unified KV cache: `llama_memory_seq_cp` needs
            one) and a forward is one `llama_decode` of B * T batch entries (split into N_BATCH-entry calls only
            for a long prefill), which batches the weight reads.
  rollback  the same rule as cache/kv_cache.py: a forward writes a row's T tokens at positions [length, length + T)
            without moving `lengths[b]`; commit moves it. What a forward wrote past the committed length is removed
            (`llama_memory_seq_rm`) before the row's next forward, so a rejected draft costs nothing until then.
            `lengths` may also be set directly (the draft proposer and the calibration do): the next forward keeps
            only [0, lengths[b]) of that row.
  trees     llama.cpp takes no attention mask, but a token may belong to several sequences, and a token attends to
            the cells of its first sequence at positions up to its own. So a tree block is scored in one decode as
            its branches: each leaf gets a scratch sequence holding the row's committed prefix (`seq_cp`, which
            shares cells, copies nothing), and each block token belongs to the scratch sequences of the leaves
            below it (the root also to the row's own). A node then sees exactly its ancestors and itself. Commit
            copies the kept path back into the row's sequence (`compact`) and empties the scratch sequences.
            Any block whose mask is a tree with positions at depth (cache/tree.py: trees, lookahead's window)
            fits; anything else is refused.
  logits    llama.cpp computes logits only at the batch entries marked as outputs: the last token of each row
            under `last_only` (a prefill), every token of a verify block otherwise. Reading them back is one
            copy of V floats (4 V bytes) per output position, ~0.2 MB per position for a 49152-token vocabulary.
  hidden    the last hidden state after the final norm (what EAGLE and Medusa heads read) is the context's
            embeddings output, switched on only for forwards that ask for it (`forward_hidden`): llama.cpp then
            outputs every position of the batch.

Sizes are checked before `llama_decode` is called (llama.cpp asserts on some, which would abort the process): token
ids inside the vocabulary, a row's length + T within the cache's max_len, a tree within one decode. A decode that
still fails raises RuntimeError with llama.cpp's own log lines: an error for the request, never a process abort.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import faults
from ..config import ConfigError
from .base import LoadedModel
from .llama import Scored

log = logging.getLogger(__name__)

EXTRA = "llamacpp"
INSTALL = f'pip install "leaplm[{EXTRA}]"'
N_BATCH = 512          # batch entries per llama_decode (a longer prefill is split; a tree must fit in one)
ROW_N_BATCH = 128      # the same for a row's own context (LlamaCppRows): its compute buffer scales with it
TREE_SEQS = 64         # scratch sequences for a tree block's leaves
TREE_SLACK = 512       # KV cells beyond rows * max_len: a tree block's nodes live in scratch sequences
# ggml type ids of the KV cache: 'auto' is llama.cpp's own default (f16), as its command-line tools run
KV_TYPES = {"auto": 1, "float16": 1, "float32": 0, "bfloat16": 30}
KV_BYTES = {0: 4, 1: 2, 30: 2}
LOG_LEVELS = {1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.DEBUG}


def available() -> bool:
    """Whether llama-cpp-python (the `llamacpp` extra) is installed, without loading libllama."""
    return importlib.util.find_spec("llama_cpp") is not None


_lib = None
_lib_lock = threading.Lock()
_log_lines: deque[str] = deque(maxlen=40)      # libllama's recent log lines, for error messages
_log_count = [0]                               # lines logged so far
_log_callback = None                           # kept referenced: libllama calls it
_contexts = [0]                                # llama.cpp contexts alive in this process (created - freed)
_contexts_lock = threading.Lock()


def live_contexts() -> int:
    """llama.cpp contexts created and not freed yet, every model's (what a leak of contexts would grow)."""
    return _contexts[0]


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


def _recent_log(since: int) -> str:
    """libllama's log lines since the count `since` (the last few), joined."""
    n = min(6, _log_count[0] - since, len(_log_lines))
    return " | ".join(line.strip() for line in list(_log_lines)[len(_log_lines) - n:]) if n > 0 else ""


class LlamaCppLM:
    """A GGUF file loaded by libllama, behind the CausalLM protocol (models/base.py)."""

    supports_tree = True
    supports_batch = True
    backend = "llamacpp"
    device = torch.device("cpu")
    dtype = torch.float32                      # of the logits and hidden states it returns

    def __init__(self, path: str | Path, *, kv_cache_dtype: str = "auto", threads: int | None = None,
                 repack: bool = True, flash_attn: bool | None = None, field: str = "model"):
        """kv_cache_dtype: KV_TYPES; threads: None = torch's thread count (--threads sets it); repack: llama.cpp's
        repacked CPU weight layouts; flash_attn: True / False, or None = chosen at the first cache by the
        start-up check (see batch_variance): llama.cpp's flash attention where it is batch-invariant, else
        without it where that is, else with it (llama.cpp's own default on the CPU)."""
        lc = libllama(field)
        if kv_cache_dtype not in KV_TYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_TYPES)}, got {kv_cache_dtype!r}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ConfigError("threads", f"must be an integer >= 1, got {threads!r}")
        self.lc = lc
        self.path = str(path)
        self.kv_type = KV_TYPES[kv_cache_dtype]
        self.threads = threads
        self.repack = repack
        self._tensors: dict[str, torch.Tensor] = {}          # dequantized tensors heads read (embedding, head)
        self.flash_attn = {None: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                           False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        self._choose_attention = flash_attn is None
        self._variance: float | None = None
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = repack            # llama.cpp's repacked CPU layouts (see docs: batch invariance)
        seen = _log_count[0]
        model = lc.llama_model_load_from_file(self.path.encode(), mp)
        if not model:
            raise ConfigError(field, f"{self.path}: libllama cannot load this file ({_recent_log(seen) or 'no reason given'})")
        self._model = model
        self._free = weakref.finalize(self, lc.llama_model_free, model)
        vocab = lc.llama_model_get_vocab(model)
        self._vocab = vocab
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.hidden_size = int(lc.llama_model_n_embd(model))
        self.num_layers = int(lc.llama_model_n_layer(model))
        self.max_len = int(lc.llama_model_n_ctx_train(model))
        self.n_params = int(lc.llama_model_n_params(model))
        n_head, n_head_kv = int(lc.llama_model_n_head(model)), int(lc.llama_model_n_head_kv(model))
        self.kv_width = self.hidden_size // max(1, n_head) * n_head_kv     # per layer, K and V each

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits are bit for bit the same however it is batched (batch_variance == 0)."""
        return self.batch_variance == 0.0

    @property
    def batch_variance(self) -> float:
        """The largest logit difference measured once per model between a row scored one token at a time and the
        same tokens inside blocks of 2, 3 and 18 batch entries, after a context long enough (2 rows x 140 tokens)
        for llama.cpp's one-token flash attention to split the KV cells across threads. llama.cpp's block and
        one-token kernels round differently for some weight types (F32 and F16 through llamafile's sgemm) and
        for attention (without flash attention: f16 products through different kernels; with it, at 2 or more
        threads: the split KV), so where this is not 0, speculation's greedy output equals plain decoding's only
        up to that rounding: a near-tie may break the other way (docs/backends.md)."""
        if self._variance is None:
            key = self._variance_key()            # before the choice below changes what it hashes
            self._variance_from_cache()
        if self._variance is None:
            if self._choose_attention:
                self._choose_attention = False
                tried = {}
                for fa in (self.lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, self.lc.LLAMA_FLASH_ATTN_TYPE_DISABLED):
                    self.flash_attn = fa
                    tried[fa] = self._measure_variance()
                    if tried[fa] == 0.0:
                        break
                self.flash_attn = min(tried, key=lambda fa: (tried[fa] != 0.0, -fa))   # invariant, else FA on
                self._variance = tried[self.flash_attn]
            else:
                self._variance = self._measure_variance()
            from .. import startup_cache

            startup_cache.write_json("batch-variance", key, {"variance": self._variance,
                                                             "flash_attn": int(self.flash_attn)})
            log.info("%s: llama.cpp is %s on this CPU (flash attention %s, %s threads)", self.path,
                     "batch-invariant" if self._variance == 0 else f"NOT batch-invariant (logits move by up to "
                     f"{self._variance:.3g})", "on" if self.flash_attn == self.lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
                     else "off", self.threads or torch.get_num_threads())
        return self._variance

    def _variance_key(self) -> str:
        from .. import startup_cache

        return startup_cache.key("batch-variance", startup_cache.file_identity(self.path), self.threads or
                                 torch.get_num_threads(), self.kv_type, self.repack, self._choose_attention,
                                 self.flash_attn, getattr(self.lc, "__version__", ""))

    def _variance_from_cache(self) -> None:
        """The start-up check's result when this machine measured it for this file and thread count before
        (startup_cache.py); it is stored after each measurement (batch_variance)."""
        from .. import startup_cache

        hit = startup_cache.read_json("batch-variance", self._variance_key())
        if hit is not None and isinstance(hit.get("variance"), (int, float)):
            self.flash_attn, self._variance = int(hit["flash_attn"]), float(hit["variance"])
            self._choose_attention = False

    def _measure_variance(self) -> float:
        g = torch.Generator().manual_seed(0)
        n_ctx = 140
        ctx = torch.randint(0, self.vocab_size, (2, n_ctx), generator=g)                 # [2, 140]
        block = torch.randint(0, self.vocab_size, (2, 9), generator=g)                   # [2, 9]
        cache = LlamaCppCache(self, 2, n_ctx + 16)
        self(ctx, cache, last_only=True)
        cache.advance(n_ctx, 0)
        cache.advance(n_ctx, 1)
        # row 0's tokens in batches of 18, 2 and 3 entries (llama.cpp picks kernels by the batch's size), then
        # one at a time (1 entry)
        ways = [self(block, cache)[0], self(block[:, :1], cache)[0], self(block[:1, :3], cache)[0]]
        alone = []
        for t in range(9):
            alone.append(self(block[:1, t: t + 1], cache)[0, 0])
            cache.advance(1, 0)
        alone = torch.stack(alone)                                                       # [9, V]
        diff = max(float((w - alone[: w.shape[0]]).abs().max()) for w in ways)
        # a tree block on row 1, its path [root, node 0, node 2] kept: the next token as after a fresh prefill
        # (the kept cells are not contiguous; attention must not depend on the gaps)
        from ..cache.tree import tree_layout

        lay = tree_layout([-1, -1, 0, 1])
        row1 = cache.row_view(1)
        tree = torch.cat([ctx[1, -1:], block[1, :4]]).unsqueeze(0)                       # [1, 5]
        cache.truncate(n_ctx - 1, 1)
        row1.lengths[0] = n_ctx - 1
        self(tree, row1, tree_mask=lay.mask, position_offsets=lay.depths)
        cache.compact([0, 1, 3], 1)
        cache.advance(3, 1)
        nxt = self(block[1:, 8:9], cache.row_view(1))[0, 0]
        fresh = LlamaCppCache(self, 1, n_ctx + 16)
        self(torch.cat([ctx[1], block[1, [0, 2]]]).unsqueeze(0), fresh, last_only=True)
        fresh.advance(n_ctx + 2)
        return max(diff, float((nxt - self(block[1:, 8:9], fresh)[0, 0]).abs().max()))

    def embed_weight(self) -> torch.Tensor:
        """[V, hidden] fp32: the token embedding, dequantized from the file (EAGLE heads read it)."""
        return self._tensor("token_embd.weight")

    def head_weight(self) -> torch.Tensor:
        """[V, hidden] fp32: the output projection (the embedding when tied), dequantized from the file as
        libllama computes with it (Medusa heads and EAGLE heads without their own vocabulary read it)."""
        return self._tensor("output.weight") if "output.weight" in self._tensor_names() else self.embed_weight()

    def bytes_per_forward(self) -> int:
        """Bytes one forward of one token reads: every matrix as stored and one embedding row (the whole
        embedding when the output projection is tied to it)."""
        from gguf import GGUFReader

        total = embd = 0
        tied = True
        for t in GGUFReader(self.path).tensors:
            total += int(t.n_bytes)
            if t.name == "token_embd.weight":
                embd = int(t.n_bytes)
            tied &= t.name != "output.weight"
        return total if tied else total - embd + embd // max(1, self.vocab_size)

    def _tensor_names(self) -> set[str]:
        from gguf import GGUFReader

        return {t.name for t in GGUFReader(self.path).tensors}

    def _tensor(self, name: str) -> torch.Tensor:
        """A tensor of the file dequantized to fp32 [rows, hidden], read once."""
        if name not in self._tensors:
            from gguf import GGUFReader
            from gguf.quants import dequantize

            t = next(t for t in GGUFReader(self.path).tensors if t.name == name)
            w = dequantize(t.data, t.tensor_type)
            self._tensors[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(
                -1, self.hidden_size)
        return self._tensors[name]

    def eog_ids(self) -> list[int]:
        """Tokens libllama ends generation on (EOS, EOT, ...)."""
        return [t for t in range(self.vocab_size) if self.lc.llama_vocab_is_eog(self._vocab, t)]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as libllama holds them."""
        return int(self.lc.llama_model_size(self._model))

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_width * KV_BYTES.get(self.kv_type, 2)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> "LlamaCppCache | LlamaCppRows":
        """Rows in contexts of their own where llama.cpp is batch-invariant for this file (so a row's logits do not
        depend on the other rows: see the module docstring), else rows as sequences of one context."""
        invariant = self.batch_invariant       # measured once; also chooses flash attention before any context
        if batch_size > 1 and invariant:
            return LlamaCppRows(self, batch_size, max_len or self.max_len)
        # a lone row decodes in llama_decode calls of the same size as a row of LlamaCppRows, so a long prompt
        # is split the same way whichever cache holds it
        return LlamaCppCache(self, batch_size, max_len or self.max_len,
                             n_batch=ROW_N_BATCH if invariant else N_BATCH)

    def parameters(self):                      # what callers count; libllama holds the weights
        return iter(())

    def eval(self):
        return self

    # --- forwards ----------------------------------------------------------------------------------------------
    ragged = True          # forwards take row_tokens: a batch's rows need not be padded to one length

    def forward(self, input_ids: torch.Tensor, cache, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                last_only: bool = False, row_tokens: Sequence[int] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only); see the module docstring.
        row_tokens: row b's first row_tokens[b] tokens are real, the rest padding that is neither decoded nor
        written (its logits are zeros); None: every token is real."""
        return self._run(input_ids, cache, tree_mask, position_offsets, layers, last_only, False, False,
                         row_tokens).logits

    __call__ = forward

    def forward_hidden(self, input_ids: torch.Tensor, cache, *, tree_mask: torch.Tensor | None = None,
                       position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                       last_only: bool = False, hidden_all: bool = False,
                       row_tokens: Sequence[int] | None = None) -> Scored:
        """forward() and the last hidden state after the final norm, [B, T, hidden] (every position with
        hidden_all; logits still [B, 1, V] with last_only)."""
        return self._run(input_ids, cache, tree_mask, position_offsets, layers, last_only, True, hidden_all,
                         row_tokens)

    def _run(self, input_ids, cache, tree_mask, position_offsets, layers, last_only, hidden, hidden_all,
             row_tokens=None) -> Scored:
        if layers is not None:
            raise ValueError("libllama runs every layer of the model: a layer subset (layerskip) needs the torch "
                             "backend (--backend torch)")
        if isinstance(cache, LlamaCppRows):
            return self._run_rows(input_ids, cache, tree_mask, position_offsets, last_only, hidden, hidden_all,
                                  row_tokens)
        parent, seqs, lens = _resolve(cache, input_ids.shape[0])
        if parent.lm is not self:
            raise ValueError("this cache belongs to another llama.cpp model")
        B, T = input_ids.shape
        ids = input_ids.tolist()
        bad = [t for row in ids for t in row if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        longest = max(lens)
        if longest + T > parent.max_len:
            raise ValueError(f"KV cache full: {longest} + {T} tokens exceed max_len={parent.max_len}")
        for s, n in zip(seqs, lens):
            parent.sync(s, n)
        if tree_mask is not None:
            if B != 1:
                raise ValueError("a tree block is scored one row at a time")
            entries, n_out = parent.tree_entries(seqs[0], lens[0], ids[0], tree_mask, position_offsets)
            rows_out = [(0, t) for t in range(T)]
        else:
            if position_offsets is not None:
                offs = position_offsets.tolist()
                if offs != list(range(T)):
                    raise ValueError("position offsets without a tree mask must be 0..T-1")
            real = list(row_tokens) if row_tokens is not None else [T] * B
            if len(real) != B or any(not 0 <= r <= T for r in real):
                raise ValueError(f"row_tokens must be {B} counts in [0, {T}], got {real}")
            if last_only and real != [T] * B:
                raise ValueError("last_only takes unpadded rows")
            want = (lambda t: t == T - 1) if last_only and not hidden else (lambda t: True)
            entries = [(ids[b][t], lens[b] + t, (seqs[b],), want(t)) for b in range(B) for t in range(real[b])]
            rows_out = [(b, t) for b in range(B) for t in range(real[b])]
            for s, n, r in zip(seqs, lens, real):
                parent.written[s] = max(parent.written[s], n + r)
            parent.clear_tree()
        return parent.decode(entries, rows_out, B, T, last_only, hidden, hidden_all)


    def _run_rows(self, input_ids, cache: "LlamaCppRows", tree_mask, position_offsets, last_only, hidden,
                  hidden_all, row_tokens) -> Scored:
        """A forward over rows that each have a context: one decode per row with real tokens, gathered."""
        B, T = input_ids.shape
        if B > cache.batch_size:
            raise ValueError(f"{B} rows for a cache of {cache.batch_size}")
        if tree_mask is not None and B != 1:
            raise ValueError("a tree block is scored one row at a time")
        real = list(row_tokens) if row_tokens is not None else [T] * B
        if len(real) != B or any(not 0 <= r <= T for r in real):
            raise ValueError(f"row_tokens must be {B} counts in [0, {T}], got {real}")
        logits = torch.zeros(B, 1 if last_only else T, self.vocab_size)                # [B, T | 1, V]
        hid = torch.zeros(B, T, self.hidden_size) if hidden else None                   # [B, T, hid]
        for b in range(B):
            if real[b] == 0:
                continue                     # a padding row: nothing decoded, nothing written
            out = self._run(input_ids[b: b + 1], cache.rows[b], tree_mask, position_offsets, None, last_only,
                            hidden, hidden_all, None if real[b] == T else [real[b]])
            logits[b] = out.logits[0]
            if hidden:
                hid[b] = out.hidden[0]
        return Scored(logits, hid)


def _resolve(cache, B: int) -> tuple["LlamaCppCache", list[int], list[int]]:
    """(the context's cache, the llama.cpp sequence of each input row, each row's committed length)."""
    if isinstance(cache, LlamaCppRowView):
        if B != 1:
            raise ValueError("a row view takes one row")
        return cache.parent, [cache.row], [cache.lengths[0]]
    if not isinstance(cache, LlamaCppCache):
        raise TypeError(f"the llama.cpp backend needs its own cache (model.new_cache), got {type(cache).__name__}")
    if B > cache.batch_size:
        raise ValueError(f"{B} rows for a cache of {cache.batch_size}")
    return cache, list(range(B)), list(cache.lengths[:B])


@dataclass
class TreeSeqs:
    """The last tree block scored for a row: where its tokens live until commit."""
    row: int
    start: int               # the row's committed length (the root's position)
    seq_of: list[int]        # block row -> a sequence holding it and its ancestors (the root: the row itself)


def tree_parents(mask: torch.Tensor, depths: list[int]) -> list[int]:
    """Parent block row of every block row (-1 for row 0, the root) of a block mask [T, T] that is a tree:
    every row sees the root, itself and exactly what its parent sees, at its parent's depth + 1. ValueError
    for any other mask (llama.cpp's sequences can express only trees)."""
    m = mask.tolist()
    T = len(m)
    if not m[0][0] or any(m[0][1:]):
        raise ValueError("a tree block's row 0 (the root) must see itself only")
    parents = [-1]
    for r in range(1, T):
        seen = [c for c in range(T) if m[r][c] and c != r]
        if not m[r][r] or not seen or max(seen) >= r:
            raise ValueError(f"block row {r} does not see itself and earlier rows only: not a tree llama.cpp "
                             "can score")
        p = max(seen)
        want = [c for c in range(T) if m[p][c]]
        if seen != want or depths[r] != depths[p] + 1:
            raise ValueError(f"block row {r}'s mask is not its parent's plus itself: not a tree llama.cpp "
                             "can score")
        parents.append(p)
    return parents


class _CacheSizes:
    """What the server's metrics and admission read of a libllama cache, and the room checks (both caches: they
    have lm, max_len, lengths and batch_size)."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as libllama holds them."""
        return self.lm.weight_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.lm.bytes_per_token

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def capacity_tokens(self) -> int:
        return self.batch_size * self.max_len

    def check_room(self, T: int, B: int = 1) -> None:
        longest = max(self.lengths[:B])
        if longest + T > self.max_len:
            raise ValueError(f"KV cache full: {longest} + {T} tokens exceed max_len={self.max_len}")

    def reserve(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"KV cache full: {needed} slots exceed max_len={self.max_len}")

    def advance(self, n: int, row: int = 0) -> None:
        self.lengths[row] += n


class LlamaCppCache(_CacheSizes):
    """One llama.cpp context: rows [0, batch_size) are its sequences (see the module docstring). Same interface as
    cache.kv_cache.KVCache: lengths, advance, truncate, compact, move_row, row_view, reset_row, check_room."""

    def __init__(self, lm: LlamaCppLM, batch_size: int, max_len: int, lengths: "list[int] | _RowLength | None" = None,
                 n_batch: int = N_BATCH):
        """lengths: the committed lengths to keep (LlamaCppRows hands each row's context a view of its own
        list); n_batch: batch entries per llama_decode."""
        lc = lm.lc
        self.lm, self.lc = lm, lc
        self.max_len = max_len
        self.n_batch = n_batch
        self.lengths = lengths if lengths is not None else [0] * batch_size   # committed tokens per row
        self.written = [0] * batch_size        # positions [0, written[b]) may hold cells in sequence b
        self.tree: TreeSeqs | None = None
        self.n_seq = batch_size + TREE_SEQS
        if self.n_seq > 256:
            raise ValueError(f"the llama.cpp backend runs at most {256 - TREE_SEQS} rows, got {batch_size}")
        cp = lc.llama_context_default_params()
        self.n_ctx = batch_size * max_len + TREE_SLACK
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = self.n_seq
        cp.kv_unified = True
        threads = lm.threads or torch.get_num_threads()
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = lm.kv_type
        cp.flash_attn_type = lm.flash_attn
        cp.embeddings = False
        cp.no_perf = True
        seen = _log_count[0]
        ctx = lc.llama_init_from_model(lm._model, cp)
        if not ctx:
            raise RuntimeError(f"libllama could not create a context of {self.n_ctx} cells for {batch_size} rows "
                               f"({_recent_log(seen) or 'no reason given'})")
        self.ctx = ctx
        self.mem = lc.llama_get_memory(ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, self.n_seq)
        with _contexts_lock:
            _contexts[0] += 1
        self._free = weakref.finalize(self, _free_context, lc, ctx, self.batch, lm)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, (n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, (n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, (n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, (n_batch,))
        self._seq = [b.seq_id[i] for i in range(n_batch)]
        self._embeddings = False
        self.peak_nbytes = self.nbytes

    # --- sizes (what the server's metrics and admission read) ----------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV cells allocated (libllama allocates them all with the context)."""
        return self.n_ctx * self.bytes_per_token

    def held(self) -> tuple[int, int]:
        """(KV cells, sequences holding any) as llama.cpp reports them: each sequence's position range, asked of
        the context (its rows and the tree scratch sequences), not read from this object's lengths."""
        cells = seqs = 0
        for s in range(self.n_seq):
            hi = self.lc.llama_memory_seq_pos_max(self.mem, s)
            if hi >= 0:
                cells += hi - self.lc.llama_memory_seq_pos_min(self.mem, s) + 1
                seqs += 1
        return cells, seqs

    # --- llama.cpp memory ------------------------------------------------------------------------------------------
    def _rm(self, seq: int, p0: int, p1: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def sync(self, seq: int, length: int) -> None:
        """Before a forward of row `seq` at `length`: drop what earlier forwards wrote past it."""
        if self.written[seq] > length:
            self._rm(seq, length)
            self.written[seq] = length

    def clear_tree(self) -> None:
        if self.tree is not None:
            for s in set(self.tree.seq_of):
                if s >= self.batch_size:
                    self._rm(s, -1)
            self.tree = None

    # --- commit-time operations ------------------------------------------------------------------------------------
    def truncate(self, length: int, row: int = 0) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"truncate to {length} outside [0, {self.lengths[row]}]")
        self.lengths[row] = length
        self._rm(row, length)
        self.written[row] = length

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0
        self._rm(row, 0)
        self.written[row] = 0

    def compact(self, offsets: list[int], row: int = 0) -> None:
        """After a tree block of `row`: make its kept path (block rows `offsets`, root first) the row's cells from
        its length on: the path's sequence, copied into the row's (cells are shared, not copied)."""
        tree = self.tree
        if tree is None or tree.row != row or tree.start != self.lengths[row]:
            if any(o != i for i, o in enumerate(offsets)):
                raise ValueError("compact: no tree block was scored for this row")
            return
        last = offsets[-1]
        L = tree.start
        if last != 0:
            self._rm(row, L + 1)
            self.lc.llama_memory_seq_cp(self.mem, tree.seq_of[last], row, L + 1, L + len(offsets))
        self.written[row] = L + len(offsets)
        self.clear_tree()

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed cells become row dst's too (shared cells: no copy)."""
        self.sync(src, self.lengths[src])
        self._rm(dst, -1)
        n = self.lengths[src]
        if n:
            self.lc.llama_memory_seq_cp(self.mem, src, dst, 0, n)
        self.lengths[dst] = self.written[dst] = n

    def row_view(self, row: int) -> "LlamaCppRowView":
        return LlamaCppRowView(self, row)

    # --- one decode ------------------------------------------------------------------------------------------------
    def tree_entries(self, row: int, L: int, ids: list[int], mask: torch.Tensor, depths: torch.Tensor | None):
        """Batch entries (token, position, sequences, output) of a tree block of `row` at committed length L."""
        T = len(ids)
        dl = depths.tolist() if depths is not None else list(range(T))
        if T > self.n_batch:
            raise ValueError(f"a tree block of {T} tokens exceeds one llama_decode ({self.n_batch})")
        parents = tree_parents(mask, dl)
        kids = [0] * T
        for p in parents[1:]:
            kids[p] += 1
        leaves = [r for r in range(T) if kids[r] == 0 and r > 0]
        if len(leaves) > TREE_SEQS:
            raise ValueError(f"a tree block with {len(leaves)} leaves exceeds the {TREE_SEQS} scratch sequences")
        self.clear_tree()
        under: list[list[int]] = [[] for _ in range(T)]
        for j, leaf in enumerate(leaves):
            s = self.batch_size + j
            self._rm(s, -1)
            if L:
                self.lc.llama_memory_seq_cp(self.mem, row, s, 0, L)
            r = leaf
            while r > 0:
                under[r].append(s)
                r = parents[r]
        under[0] = [row] + [self.batch_size + j for j in range(len(leaves))]
        self.tree = TreeSeqs(row, L, [row] + [under[r][0] for r in range(1, T)])
        self.written[row] = max(self.written[row], L + 1)
        return [(ids[r], L + dl[r], tuple(under[r]), True) for r in range(T)], T

    def decode(self, entries, rows_out, B: int, T: int, last_only: bool, hidden: bool, hidden_all: bool) -> Scored:
        """Run the entries through llama_decode (N_BATCH at a time) and gather logits [B, T | 1, V] and, with
        hidden, the hidden states [B, T, hid]."""
        lc, V = self.lc, self.lm.vocab_size
        if hidden != self._embeddings:
            lc.llama_set_embeddings(self.ctx, hidden)
            self._embeddings = hidden
        # gathered with numpy: a torch copy wakes torch's thread pool, which on a busy CPU costs milliseconds
        logits = np.zeros((B, 1 if last_only else T, V), dtype=np.float32)                 # [B, T | 1, V]
        hid = np.zeros((B, T, self.lm.hidden_size), dtype=np.float32) if hidden else None  # [B, T, hid]
        full = len(entries) == B * T
        for c0 in range(0, len(entries), self.n_batch):
            chunk = entries[c0: c0 + self.n_batch]
            n = len(chunk)
            self._tok[:n] = [e[0] for e in chunk]
            self._pos[:n] = [e[1] for e in chunk]
            self._nseq[:n] = [len(e[2]) for e in chunk]
            self._out[:n] = [1 if (e[3] or hidden) else 0 for e in chunk]
            for i, e in enumerate(chunk):
                ptr = self._seq[i]
                for j, s in enumerate(e[2]):
                    ptr[j] = s
            self.batch.n_tokens = n
            seen = _log_count[0]
            if faults.PLAN and faults.at("llamacpp", int(self._pos[:n].max())):
                rc = 1                         # injected (faults.py): what a context without free cells returns
            else:
                rc = lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                what = {1: "no free KV cells", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
                raise RuntimeError(f"llama_decode failed ({rc}: {what}): {_recent_log(seen) or 'no reason given'}")
            outs = [c0 + i for i, e in enumerate(chunk) if e[3] or hidden]      # entry index of each output row
            if not outs:
                continue
            lg = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), (len(outs), V))          # [n_out, V]
            where = [rows_out[i] for i in outs]
            if hidden:
                emb = np.ctypeslib.as_array(lc.llama_get_embeddings(self.ctx), (len(outs), self.lm.hidden_size))
                hid[[w[0] for w in where], [w[1] for w in where]] = emb
            keep = [(k, w) for k, w in enumerate(where) if not last_only or w[1] == T - 1]
            if not keep:
                continue
            if full and not last_only and len(keep) == B * T:
                logits.reshape(B * T, V)[:] = lg
            elif len(keep) == 1:
                k, w = keep[0]
                logits[w[0], 0 if last_only else w[1]] = lg[k]
            else:
                logits[[w[0] for _, w in keep], [0 if last_only else w[1] for _, w in keep]] = \
                    lg[[k for k, _ in keep]]
        return Scored(torch.from_numpy(logits), torch.from_numpy(hid) if hidden else None)


class _RowLength:
    """Row `row` of a LlamaCppRows' lengths, seen by that row's own context as its one-row `lengths` list."""

    def __init__(self, owner: list[int], row: int):
        self.owner, self.row = owner, row

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.owner[self.row]][i]
        if i not in (0, -1):
            raise IndexError(i)
        return self.owner[self.row]

    def __setitem__(self, i, value: int) -> None:
        if i not in (0, -1):
            raise IndexError(i)
        self.owner[self.row] = value

    def __iter__(self):
        return iter([self.owner[self.row]])


class LlamaCppRows(_CacheSizes):
    """Rows in llama.cpp contexts of their own (see the module docstring: a row's attention must not depend on
    where other rows' cells lie). Same interface as LlamaCppCache; `lengths` is one list, each row's context
    reads and writes its own entry. Moving a row moves its context (nothing is copied)."""

    def __init__(self, lm: LlamaCppLM, batch_size: int, max_len: int):
        self.lm = lm
        self.max_len = max_len
        self.lengths = [0] * batch_size        # committed tokens per row
        self.rows = [LlamaCppCache(lm, 1, max_len, _RowLength(self.lengths, b), n_batch=ROW_N_BATCH)
                     for b in range(batch_size)]
        self.peak_nbytes = self.nbytes

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def held(self) -> tuple[int, int]:
        """(KV cells, sequences holding any) over the rows' contexts, as llama.cpp reports them."""
        per = [r.held() for r in self.rows]
        return sum(c for c, _ in per), sum(s for _, s in per)

    def truncate(self, length: int, row: int = 0) -> None:
        self.rows[row].truncate(length, 0)

    def reset_row(self, row: int) -> None:
        self.rows[row].reset_row(0)

    def compact(self, offsets: list[int], row: int = 0) -> None:
        self.rows[row].compact(offsets, 0)

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed cells become row dst's: src's context moves to dst (its cells stay where they
        are, so dst decodes on exactly as src would have) and src gets dst's old context, emptied. Unlike a
        shared context's move, src is left empty: the engine frees src right after a move anyway."""
        if src == dst:
            return
        a, b = self.rows[src], self.rows[dst]
        a.sync(0, self.lengths[src])
        self.rows[dst], self.rows[src] = a, b
        a.lengths.row, b.lengths.row = dst, src
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0
        b.clear_tree()
        b._rm(0, -1)
        b.written[0] = 0

    def row_view(self, row: int) -> "LlamaCppRowView":
        return LlamaCppRowView(self.rows[row], 0)


def _free_context(lc, ctx, batch, lm) -> None:
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    with _contexts_lock:
        _contexts[0] -= 1


class LlamaCppRowView:
    """Row `row` of a LlamaCppCache seen as a batch-1 cache (the step prefills a joining row through it). Its
    length is a copy; commits go to the parent (advance(n, row) there)."""

    def __init__(self, parent: LlamaCppCache, row: int):
        self.parent, self.row = parent, row
        self.lengths = [parent.lengths[row]]
        self.max_len = parent.max_len

    @property
    def batch_size(self) -> int:
        return 1

    def check_room(self, T: int, B: int = 1) -> None:
        if self.lengths[0] + T > self.max_len:
            raise ValueError(f"KV cache full: {self.lengths[0]} + {T} tokens exceed max_len={self.max_len}")


def check_file(path: str, field: str = "model") -> None:
    """ConfigError with libllama's reason when it cannot load the GGUF file at `path` (its vocabulary and
    metadata are read, not its weights)."""
    lc = libllama(field)
    mp = lc.llama_model_default_params()
    mp.vocab_only = True
    seen = _log_count[0]
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ConfigError(field, f"{path}: libllama cannot load this file ({_recent_log(seen) or 'no reason given'})")
    lc.llama_model_free(model)


def load_llamacpp_model(name: str, field: str = "model", kv_cache_dtype: str = "auto",
                        threads: int | None = None):
    """A GGUF file on libllama: checked, loaded with its own weight types, tokenizer built as the torch path
    builds it (transformers' GGUF converter), so both backends tokenize identically."""
    from .gguf import inspect_gguf, load_gguf_tokenizer, read_gguf_config
    from .tokens import bos_to_add

    info = inspect_gguf(name, field, check_types=False)
    model = LlamaCppLM(info.path, kv_cache_dtype=kv_cache_dtype, threads=threads, field=field)
    tok = load_gguf_tokenizer(info, field)
    cfg = read_gguf_config(info, field)
    from .llama import args_from_hf_config

    model.args = args_from_hf_config(cfg)     # the shapes heads and tolerances read (what the file describes)
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = [tok.eos_token_id]
    log.info("loaded %s on libllama (GGUF %s, %.1fM parameters, weights as stored)", name, info.architecture,
             model.n_params / 1e6)
    return LoadedModel(model, tok, str(info.path), name, cfg, eos_ids, model.n_params, bos_to_add(tok),
                       backend="llamacpp")
