"""Load a model and its tokenizer from a Hugging Face checkpoint: a local directory or, with a network, a hub id.

Native families (models/arch: one description each) are built from config.json and the safetensors shards directly;
any other causal LM goes through transformers (hf.HFCausalLM).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..devices import available_memory
from ..quant.formats import GGUF_TYPES
from .base import LoadedModel
from .draft_vocab import VocabMappedDraft, has_draft_vocab, read_d2t
from .llama import LlamaForCausalLM
from .native_config import native_blockers
from .arch import arch_of
from .tokens import prompt_bos

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_MODEL_LEN = 4096     # the context when --max-model-len is not given (if the model allows it)


def resolve_max_model_len(requested: int | None, model_max: int, name: str) -> int:
    """The context (prompt + output) requests get: --max-model-len, or min(the model's, DEFAULT_MAX_MODEL_LEN).
    A config allowing 131072 positions must not decide the memory a first `generate` reserves."""
    if requested is None:
        n = min(model_max, DEFAULT_MAX_MODEL_LEN)
        log.info("max_model_len %d for %s (its config allows %d positions; --max-model-len to change)", n, name,
                 model_max)
        return n
    if requested > model_max:
        raise ConfigError("max_model_len", f"{requested} exceeds the {model_max} positions {name} supports "
                                           f"(max_position_embeddings)")
    return requested


def resolve_dtype(dtype: str, checkpoint_dtype: str | None, name: str) -> str:
    """--dtype: a name in DTYPES, or 'auto' = the checkpoint's own (float32 when it names none we run)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ConfigError("dtype", f"must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
        return dtype
    chosen = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
    log.info("dtype auto: %s for %s (the checkpoint says %s)", chosen, name, checkpoint_dtype)
    return chosen


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> torch.dtype:
    """--kv-cache-dtype: 'auto' follows the weights' dtype."""
    if kv_cache_dtype == "auto":
        return DTYPES[dtype]
    if kv_cache_dtype not in DTYPES:
        raise ConfigError("kv_cache_dtype", f"must be auto or one of {', '.join(DTYPES)}, got {kv_cache_dtype!r}")
    return DTYPES[kv_cache_dtype]


def resolve_path(name: str, field: str = "model") -> Path:
    """A local checkpoint directory for `name`; downloads a hub id when a network is there."""
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ConfigError(field, f"{name!r} is a directory without config.json, not a Hugging Face checkpoint")
        return p
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~")) and not p.exists()
    if not looks_like_hub_id:
        raise ConfigError(field, f"model path {name!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                             "*.jinja"]))
    except Exception as e:  # no network, unknown repo, gated...
        raise ConfigError(field, f"{name!r} is not a local directory and could not be fetched from the hub "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def check_source(name: str, field: str = "model", backend: str = "auto") -> None:
    """What can be checked about `name` without loading weights (a GGUF file's header and tensor types, a local
    directory's config.json), so a command that loads in the background (serve) refuses bad input at once."""
    from .catalog import resolve_model_name
    from .gguf import inspect_gguf, is_gguf

    name = resolve_model_name(name, field)     # `smollm2` -> its fetched file, as load_model reads it
    if is_gguf(name):
        if choose_backend(backend, True, name) == "llamacpp":
            from .llamacpp.binding import check_file

            inspect_gguf(name, field, check_types=False, check_arch=False)
            check_file(name, field)             # libllama reads the header and metadata (no weights)
        else:
            inspect_gguf(name, field)
        return
    p = Path(name).expanduser()
    if p.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        resolve_path(name, field)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shards = sorted(path.glob("*.safetensors"))
    if shards:
        sd: dict[str, torch.Tensor] = {}
        for s in shards:
            sd.update(load_file(str(s)))
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for b in bins:
            sd.update(torch.load(str(b), map_location="cpu", weights_only=True))
        return sd
    raise ConfigError("model", f"{path} has no *.safetensors or pytorch_model*.bin weights")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer. The shipped models' (saved by transformers' fast tokenizer) are read with the
    tokenizers library alone (gguf.CachedTokenizer: no transformers import at start-up)."""
    from .embedded import EMBEDDED_DIR

    if Path(path).resolve().parent == EMBEDDED_DIR and (Path(path) / "tokenizer.json").exists() \
            and (Path(path) / "tokenizer_config.json").exists():
        from .gguf import CachedTokenizer

        return CachedTokenizer(Path(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_native(cfg: dict, hf_state_dict: dict[str, torch.Tensor], device: str, td: torch.dtype,
                 cache_td: torch.dtype | None = None):
    """The native Llama-family model from a Hugging Face config dict and state dict (Hugging Face names)."""
    from .llama import meta_model
    from .native_config import args_from_hf_config, fuse_hf_state_dict

    args = args_from_hf_config(cfg)
    model = meta_model(args)
    sd = fuse_hf_state_dict(hf_state_dict, args)
    # assign: the meta parameters become the state dict's tensors (no empty model allocated first, to be replaced)
    model.load_state_dict({k: v.to(device=device, dtype=td) for k, v in sd.items()}, strict=True, assign=True)
    # non-persistent buffers: rebuild them on the real device
    model.reset_buffers(device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model._fast = None
    model.cache_dtype = cache_td
    model.eval()
    return model


def load_gguf_model(name: str, device: str, dtype: str, field: str = "model",
                    quantization: str | None = None, kv_cache_dtype: str = "auto") -> LoadedModel:
    """A GGUF file (see gguf.py): checked, tokenizer built, tensors dequantized to `dtype`."""
    from .gguf import file_dtype, inspect_gguf, load_gguf_tokenizer, read_gguf_checkpoint

    info = inspect_gguf(name, field)
    dtype = resolve_dtype(dtype, file_dtype(info), name)
    cache_td = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    if quantization == "gguf" and dtype == "float32" and str(device) == "cpu":
        from .gguf_kernel import load_gguf_kernel

        loaded = load_gguf_kernel(info, name, field, cache_td)    # the file's blocks, never dequantized
        if loaded is not None:
            return loaded
    tok = load_gguf_tokenizer(info, field)
    td = DTYPES[dtype]
    cfg, sd = read_gguf_checkpoint(info, td, field)
    blockers = native_blockers(cfg)
    if blockers:
        raise ConfigError(field, f"{name}: config field {blockers[0]} is not implemented for GGUF files")
    model = build_native(cfg, sd, device, td, cache_td)
    del sd
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = [tok.eos_token_id]
    n_params = sum(p.numel() for p in model.parameters())
    if quantization is not None:
        _quantize(model, quantization, device, field, gguf_path=str(info.path))
    log.info("loaded %s (GGUF %s, %.1fM parameters, dequantized to %s)", name, info.architecture, n_params / 1e6,
             dtype)
    return LoadedModel(model, tok, str(info.path), name, cfg, eos_ids, n_params, prompt_bos(tok, cfg.get("model_type"), cfg.get("bos_token_id")))


def _quantize(model, quantization: str, device: str, field: str, gguf_path: str | None = None) -> None:
    from ..quant.apply import quantize_model

    if str(device) != "cpu":
        raise ConfigError("quantization", f"quantized kernels run on the CPU only, not on {device!r}")
    # a reduced-vocabulary draft: its inner model's linears (the wrapper only maps token ids)
    quantize_model(model.inner if isinstance(model, VocabMappedDraft) else model, quantization, gguf_path=gguf_path)


BACKENDS = ("auto", "llamacpp", "torch")


def draft_backend(backend: str) -> str:
    """The backend a draft is loaded with: the target's, except that a target on libllama takes a Hugging Face
    draft on torch (auto: a GGUF draft still runs on libllama)."""
    return "auto" if backend == "llamacpp" else backend


def choose_backend(backend: str, gguf: bool, name: str, device: str = "cpu", dtype: str = "float32",
                   quantization: str | None = None, field: str = "model") -> str:
    """'llamacpp' or 'torch' for model `name`. auto: a GGUF file runs on libllama when llama-cpp-python is
    installed and nothing asks for the torch path (a device other than the CPU, a half-precision --dtype,
    leaplm's own quantized kernels); everything else on torch. An explicit llamacpp that cannot run fails."""
    if backend not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    torch_only = None
    if not gguf:
        torch_only = (field, f"{name!r} is not a GGUF file; the llama.cpp backend runs GGUF files")
    elif str(device) != "cpu":
        torch_only = ("device", f"the llama.cpp backend runs on the CPU here, not on {device!r}")
    elif dtype not in ("auto", "float32"):
        torch_only = ("dtype", f"{dtype} is a torch compute dtype; libllama computes in float32 on the file's own "
                               "weight types")
    elif quantization not in (None,):
        torch_only = ("quantization", f"{quantization!r} selects leaplm's own kernels; libllama runs the "
                                      "file's own weight types")
    if backend == "auto":
        from .llamacpp.binding import available

        return "llamacpp" if torch_only is None and available() else "torch"
    if torch_only is not None:
        raise ConfigError(torch_only[0], f"--backend llamacpp: {torch_only[1]} (use --backend torch or auto)")
    from .llamacpp.binding import libllama

    libllama("backend")              # installed? (ConfigError naming the extra)
    return "llamacpp"


KERNEL_TYPES = tuple(GGUF_TYPES)             # the block types leaplm's int8 kernel computes on as stored


@dataclass(frozen=True)
class BackendChoice:
    """What `--backend auto` (or an explicit backend) picked for a target, and why (logged once, in `--json` and
    /metrics)."""
    backend: str                    # what to load with: 'llamacpp' | 'torch' | 'auto' (load_model's usual rule)
    quantization: str | None        # 'gguf' when the choice is leaplm's int8 kernel on the file's own blocks
    reason: str


def kernel_weight_type(tensor_types: dict[str, str]) -> str | None:
    """The block type of a GGUF file's decoder matrices when every one of them is a type leaplm's int8 kernel
    takes as stored (the most common, e.g. 'Q4_1'); None when some other type (F32, F16, Q5_1, Q3_K) is among
    them. 1-D tensors (norms) are F32 in every file and do not count."""
    mats = [t for n, t in tensor_types.items() if n.startswith("blk.") and t != "F32"]
    if not mats or any(t not in KERNEL_TYPES for t in mats):
        return None
    return Counter(mats).most_common(1)[0][0]


def auto_backend(method: str, weight_type: str | None, kernel_unavailable: str | None,
                 file_bytes: int = 0, free_bytes: int | None = None, costs=None) -> BackendChoice:
    """`--backend auto` for a GGUF target on the CPU with nothing else asking for a path (no --quantization,
    float32). A file in KERNEL_TYPES that fits: the engine the start-up measurement says is faster for `method`
    (costs: backend_costs.BackendCosts, timed on both; backend_costs.choose_by_costs), or leaplm's int8 kernel
    (torch, quantization 'gguf') when there is no measurement (libllama not installed). Otherwise load_model's
    usual choice (libllama when it is installed). weight_type: kernel_weight_type of the file; kernel_unavailable:
    why the kernel cannot be built here (kernels/build.unavailable_reason), None when it can; file_bytes: the
    file's tensors as stored (the kernel holds its blocks as they are, with fp32 scales: about 1.25x the file;
    models/gguf_kernel.py); free_bytes: memory available (None: unknown)."""
    if weight_type is None:
        return BackendChoice("auto", None, f"the file's matrices are not all {'/'.join(KERNEL_TYPES)}, the types "
                                           "leaplm's int8 kernel takes")
    if kernel_unavailable is not None:
        return BackendChoice("auto", None, f"leaplm's int8 kernel cannot be built here ({kernel_unavailable})")
    if free_bytes is not None and 2 * file_bytes > free_bytes:
        return BackendChoice("auto", None, f"the file's blocks for leaplm's int8 kernel ({file_bytes / 2**30:.1f} "
                                           f"GiB as stored) take more than half the memory available "
                                           f"({free_bytes / 2**30:.1f} GiB)")
    if costs is not None:
        from .backend_costs import choose_by_costs

        by = choose_by_costs(method, costs)
        if by.backend == "llamacpp":
            return BackendChoice("llamacpp", None, f"{by.reason}; libllama is faster")
        return BackendChoice("torch", "gguf", f"{by.reason}; the int8 kernel over the file's {weight_type} blocks")
    what = ("plain decoding: one token costs no more" if method == "none" else
            f"method {method} verifies blocks of tokens, which cost far less")
    return BackendChoice("torch", "gguf", f"{what} on leaplm's int8 kernel over the file's {weight_type} blocks "
                                          f"than on libllama")


NOT_INVARIANT = ("llama.cpp's kernels are not batch-invariant for this file's weight types, so method {method} runs "
                 "on torch")


def choose_target_backend(name: str, method: str, backend: str = "auto", device: str = "cpu",
                          dtype: str = "float32", quantization: str | None = None,
                          kv_cache_dtype: str = "auto") -> BackendChoice:
    """The backend choice for target `name` run with `method` (Engine calls this before loading). A speculating
    method goes to libllama only where its kernels are batch-invariant for the file: when the start-up cache holds
    that check's result (llamacpp.model.known_batch_variance), the choice is made here; otherwise the engine
    measures it on the loaded model."""
    from .catalog import resolve_model_name
    from .gguf import inspect_gguf, is_gguf

    if backend != "auto":
        return BackendChoice(backend, None, f"--backend {backend}")
    if quantization is not None:
        return BackendChoice("auto", None, f"--quantization {quantization} selects leaplm's kernels")
    try:
        path = resolve_model_name(name, "model")
    except ConfigError:
        return BackendChoice("auto", None, "")           # load_model names the problem
    if not is_gguf(path):
        return BackendChoice("auto", None, "not a GGUF file")
    if str(device) != "cpu" or dtype not in ("auto", "float32"):
        return BackendChoice("auto", None, f"--device {device} / --dtype {dtype} ask for the PyTorch path")
    from ..kernels.build import unavailable_reason
    from .gguf import ARCHITECTURES, TENSOR_TYPES

    info = inspect_gguf(path, "model", check_types=False, check_arch=False)
    if info.architecture not in ARCHITECTURES:     # only libllama may run it; without it load_model refuses
        from .llamacpp.binding import available

        return BackendChoice("llamacpp" if available() else "torch", None,
                             f"general.architecture {info.architecture!r} runs on libllama only")
    types = info.tensor_types
    weight_type = kernel_weight_type(types) if all(t in TENSOR_TYPES for t in types.values()) else None
    from .llamacpp.binding import available

    choice = auto_backend(method, weight_type, unavailable_reason() if weight_type else None,
                          info.n_bytes, available_memory())
    if choice.backend == "torch" and available():      # both engines can run it: the faster one, measured
        from .backend_costs import cached_costs

        try:
            costs = cached_costs(str(path), lambda p: load_model(p, quantization="gguf", backend="torch").model,
                                 check_invariance=method != "none")
        except (ConfigError, RuntimeError, OSError) as e:
            log.warning("backend auto: %s could not be timed on both engines (%s); the int8 kernel runs it", path, e)
            return choice
        return auto_backend(method, weight_type, None, info.n_bytes, None, costs)
    if choice.backend != "auto":
        return choice

    if not available():
        return BackendChoice("torch", None, "the llamacpp extra (llama-cpp-python) is not installed")
    if method != "none":
        from .llamacpp.model import known_batch_variance

        variance = known_batch_variance(path, kv_cache_dtype)
        if variance is not None and variance != 0.0:
            return BackendChoice("torch", None, NOT_INVARIANT.format(method=method) + " (the start-up check, cached)")
    return BackendChoice("llamacpp", None, f"{choice.reason}; GGUF files run on libllama")


def load_model(name: str, device: str = "cpu", dtype: str = "float32", field: str = "model",
               quantization: str | None = None, kv_cache_dtype: str = "auto", backend: str = "auto") -> LoadedModel:
    """Load target or draft `name`; `field` names the user's option in errors ('model' or 'draft').
    quantization: None, or 'int8' | 'int4' | 'gguf' (quant/apply.py) applied at load. dtype 'auto' takes the
    checkpoint's; kv_cache_dtype 'auto' follows dtype (libllama: its own default, f16). backend: see
    choose_backend. What loading freed goes back to the system (footprint.return_freed_memory)."""
    from .footprint import return_freed_memory

    try:
        return _load_model(name, device, dtype, field, quantization, kv_cache_dtype, backend)
    finally:
        return_freed_memory()


def _load_model(name: str, device: str, dtype: str, field: str, quantization: str | None, kv_cache_dtype: str,
                backend: str) -> LoadedModel:
    if dtype != "auto":
        resolve_dtype(dtype, None, name)
    if kv_cache_dtype != "auto":
        resolve_kv_cache_dtype(kv_cache_dtype, "float32")
    from ..quant.apply import check_quantization
    from .catalog import resolve_model_name
    from .gguf import is_gguf

    check_quantization(quantization)
    if backend not in BACKENDS:
        raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    name = resolve_model_name(name, field)     # `smollm2` -> its fetched file (`leaplm models fetch`)
    gguf = is_gguf(name)
    if choose_backend(backend, gguf, name, device, dtype, quantization, field) == "llamacpp":
        from .llamacpp.model import load_llamacpp_model

        return load_llamacpp_model(name, field, kv_cache_dtype)
    if gguf:
        return load_gguf_model(name, device, dtype, field, quantization, kv_cache_dtype)
    if quantization == "gguf":
        raise ConfigError("quantization", f"'gguf' keeps a GGUF file's own blocks, and {name!r} is not a GGUF "
                                          "file (use int8 or int4)")
    path = resolve_path(name, field)
    cfg = json.loads((path / "config.json").read_text())
    dtype = resolve_dtype(dtype, cfg.get("torch_dtype") or cfg.get("dtype"), name)
    cache_td = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    mt = cfg.get("model_type")
    tok = load_tokenizer(path)
    eos = cfg.get("eos_token_id")
    gen_cfg = path / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = [tok.eos_token_id]
    td = DTYPES[dtype]
    native = arch_of(mt) is not None
    blockers = native_blockers(cfg) if native else []
    if native and not blockers:
        model = build_native(cfg, read_state_dict(path), device, td, cache_td)
        if has_draft_vocab(path):              # a reduced-vocabulary draft: seen as one over the target's tokens
            model = VocabMappedDraft(model, read_d2t(path), cfg["leaplm_draft"]["target_vocab_size"])
    else:
        from .hf import HFCausalLM

        if blockers:   # never silently different output: the model's own code runs what ours does not
            log.warning("%s: the native %s code does not implement %s; running it through the transformers "
                        "fallback", name, mt, "; ".join(blockers))
        if cache_td != td:
            raise ConfigError("kv_cache_dtype", f"{name} runs through the transformers fallback, whose cache "
                                                f"follows the weights' dtype ({dtype}); leave --kv-cache-dtype auto")
        try:
            model = HFCausalLM.load(path, cfg, device, td, field)
        except ConfigError as e:
            if not blockers:
                raise
            raise ConfigError(field, f"{name}: config field {blockers[0]} runs neither natively nor in "
                                     f"transformers ({e.message})") from None
    n_params = sum(p.numel() for p in model.parameters())
    if quantization is not None:
        _quantize(model, quantization, device, field)
    native = model.inner if isinstance(model, VocabMappedDraft) else model
    if field == "draft" and isinstance(native, LlamaForCausalLM):
        native.one_call = True     # a draft's forward in one C++ call where it applies (models/one_call.py says why)
    log.info("loaded %s (%s, %.1fM parameters, %s)", name, mt, n_params / 1e6, dtype)
    return LoadedModel(model, tok, str(path), name, cfg, eos_ids, n_params, prompt_bos(tok, mt, cfg.get("bos_token_id")))
