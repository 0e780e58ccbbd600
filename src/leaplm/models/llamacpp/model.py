"""LlamaCppLM: a GGUF file loaded by libllama behind the CausalLM protocol (models/base.py), and its loader.
Forwards run on the caches of caches.py (see the package docstring)."""
from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ...config import ConfigError
from ..base import LoadedModel
from ..base import ModelCapabilities, Scored
from .binding import libllama, log_count, recent_log
from .caches import KV_BYTES, ROW_N_BATCH, N_BATCH, LlamaCppCache, LlamaCppRows, LlamaCppRowView

log = logging.getLogger(__name__)

# ggml type ids of the KV cache: 'auto' is llama.cpp's own default (f16), as its command-line tools run
KV_TYPES = {"auto": 1, "float16": 1, "float32": 0, "bfloat16": 30}


def repack_runs_here(lc) -> bool:
    """Whether llama.cpp's extra buffer types (its repacked CPU weight layouts) can be used in this process. Where
    libllama was built with AMX and the CPU runs it (its system info says AMX_INT8 = 1), those layouts include the
    AMX one, and llama_decode then dies with SIGSEGV in ggml_backend_amx_mul_mat (seen on SmolLM2's Q4_1 file
    and on small Q8_0 files, Xeon with AMX): a crash that no exception reports, so the layouts stay off there."""
    return b"AMX_INT8 = 1" not in lc.llama_print_system_info()


class LlamaCppLM:
    """A GGUF file loaded by libllama, behind the CausalLM protocol (models/base.py)."""

    # every layer runs (no layer subsets); rows need no padding (row_tokens)
    capabilities = ModelCapabilities(batch=True, ragged_rows=True, trees=True, hidden_states=True)
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
        if repack and not repack_runs_here(lc):
            log.info("%s: llama.cpp's repacked weight layouts are off: on a CPU with AMX they include its AMX "
                     "layout, whose matrix product crashes the process (SIGSEGV in ggml_backend_amx_mul_mat)",
                     self.path)
            repack = False
        self.repack = repack
        self._tensors: dict[str, torch.Tensor] = {}          # dequantized tensors heads read (embedding, head)
        self.quantized: dict[str, object] = {}               # libllama runs the file's own types: none of leaplm's
        self.flash_attn = {None: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, True: lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                           False: lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        self._choose_attention = flash_attn is None
        self._variance: float | None = None
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = repack            # llama.cpp's repacked CPU layouts (see docs: batch invariance)
        seen = log_count()
        model = lc.llama_model_load_from_file(self.path.encode(), mp)
        if not model:
            raise ConfigError(field, f"{self.path}: libllama cannot load this file ({recent_log(seen) or 'no reason given'})")
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
            from ... import startup_cache

            startup_cache.write_json("batch-variance", key, {"variance": self._variance,
                                                             "flash_attn": int(self.flash_attn)})
            log.info("%s: llama.cpp is %s on this CPU (flash attention %s, %s threads)", self.path,
                     "batch-invariant" if self._variance == 0 else f"NOT batch-invariant (logits move by up to "
                     f"{self._variance:.3g})", "on" if self.flash_attn == self.lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
                     else "off", self.threads or torch.get_num_threads())
        return self._variance

    def _variance_key(self) -> str:
        return variance_key(self.lc, self.path, self.threads, self.kv_type, self.repack, self._choose_attention,
                            self.flash_attn)

    def _variance_from_cache(self) -> None:
        """The start-up check's result when this machine measured it for this file and thread count before
        (startup_cache.py); it is stored after each measurement (batch_variance)."""
        from ... import startup_cache

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
        from ...cache.tree import tree_layout

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




def variance_key(lc, path: str, threads: int | None, kv_type: int, repack: bool, choose_attention: bool,
                 flash_attn: int) -> str:
    """The start-up cache's key of a file's batch-variance check (LlamaCppLM.batch_variance)."""
    from ... import startup_cache

    return startup_cache.key("batch-variance", startup_cache.file_identity(path), threads or torch.get_num_threads(),
                             kv_type, repack, choose_attention, flash_attn, getattr(lc, "__version__", ""))


def known_batch_variance(path: str, kv_cache_dtype: str = "auto", threads: int | None = None) -> float | None:
    """The batch-variance check's result for `path` as load_llamacpp_model would load it (flash attention chosen
    by the check), read from the start-up cache without loading the model; None when this machine has not
    measured it for the file and thread count. The engine decides its backend from it before loading, so a file
    whose check failed before is loaded once, on torch."""
    from ... import startup_cache

    lc = libllama("backend")
    if kv_cache_dtype not in KV_TYPES:
        return None                            # LlamaCppLM names the field
    hit = startup_cache.read_json("batch-variance", variance_key(
        lc, path, threads, KV_TYPES[kv_cache_dtype], repack_runs_here(lc), True, lc.LLAMA_FLASH_ATTN_TYPE_ENABLED))
    return float(hit["variance"]) if hit is not None and isinstance(hit.get("variance"), (int, float)) else None


def load_llamacpp_model(name: str, field: str = "model", kv_cache_dtype: str = "auto",
                        threads: int | None = None):
    """A GGUF file on libllama: checked, loaded with its own weight types, tokenizer built as the torch path
    builds it (transformers' GGUF converter), so both backends tokenize identically."""
    from ..gguf import inspect_gguf, load_gguf_tokenizer, read_gguf_config
    from ..tokens import bos_to_add

    info = inspect_gguf(name, field, check_types=False, check_arch=False)
    try:
        model = LlamaCppLM(info.path, kv_cache_dtype=kv_cache_dtype, threads=threads, field=field)
    except ConfigError as e:
        from ..gguf import ARCHITECTURES

        if info.architecture in ARCHITECTURES:
            raise
        # neither backend runs it: one error with what each said
        raise ConfigError(field, f"{name}: general.architecture {info.architecture!r} runs on neither backend: "
                                 f"libllama: {e.message}; leaplm's own forward: not supported (supported: "
                                 f"{', '.join(sorted(ARCHITECTURES))})") from e
    tok = load_gguf_tokenizer(info, field)
    cfg = read_gguf_config(info, field)
    from ..arch import arch_of
    from ..llama import args_from_hf_config

    # the shapes heads and tolerances read (what the file describes); a family leaplm's own forward lacks is read
    # with the llama description: only its sizes matter here, libllama computes the rest
    model.args = args_from_hf_config(cfg if arch_of(cfg.get("model_type")) else {**cfg, "model_type": "llama"})
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = [tok.eos_token_id]
    log.info("loaded %s on libllama (GGUF %s, %.1fM parameters, weights as stored)", name, info.architecture,
             model.n_params / 1e6)
    return LoadedModel(model, tok, str(info.path), name, cfg, eos_ids, model.n_params, bos_to_add(tok),
                       backend="llamacpp")
