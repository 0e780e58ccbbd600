"""Finding and loading a head for a target: an explicit directory (leaplm's layout, or the Speculators and
EAGLE layouts via heads/formats.py), else the head shipped in the package for that target (matched by the
target's weights' hash). A head for another target, or a damaged one, is refused naming what is wrong."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ConfigError
from ..models.embedded import EMBEDDED_DIR
from .checkpoint import FORMAT, check_target, identity_of, read_head


def shipped_heads(kind: str | None = None) -> dict[str, Path]:
    """Head directories shipped in the package, by name (optionally only one kind)."""
    out = {}
    if EMBEDDED_DIR.is_dir():
        for p in sorted(EMBEDDED_DIR.iterdir()):
            cfg = p / "config.json"
            if cfg.exists():
                meta = json.loads(cfg.read_text())
                if meta.get("format") == FORMAT and (kind is None or meta.get("kind") == kind):
                    out[p.name] = p
    return out


def default_head_dir(target, kind: str) -> Path | None:
    """The shipped head of `kind` trained for this very target, or None."""
    have = identity_of(target)
    for p in shipped_heads(kind).values():
        meta = json.loads((p / "config.json").read_text())
        if meta.get("target", {}).get("weights_sha256") == have.weights_sha256:
            return p
    return None


def load_head_for(head: str | None, target, kind: str = "eagle"):
    """The runtime head (propose.eagle.EagleHead or propose.medusa.MedusaHeads) for `target`."""
    if head is None:
        d = default_head_dir(target, kind)
        if d is None:
            raise ConfigError("head", f"no {kind} head ships for {target.name}; pass --head DIR "
                                      f"(train one with `leaplm train {kind}`)")
    else:
        d = Path(head)
        if not d.exists():
            raise ConfigError("head", f"{head!r} does not exist")
    from .formats import read_any

    hf = read_any(d, target)
    if hf.kind != kind:
        raise ConfigError("head", f"{d} holds a {hf.kind} head, not {kind}")
    check_target(d, hf.target, identity_of(target))
    return build_runtime(hf, target, d)


def target_head_weight(model) -> torch.Tensor:
    """[V, hid] fp32: the target's output projection as it computes it. Under --quantization the fp weight is
    freed (quant/apply.py) and the quantized one is dequantized here, so heads see the quantized target's head."""
    if hasattr(model, "head_weight"):                   # libllama (models/llamacpp.py): read from the file
        return model.head_weight()
    q = getattr(model, "quantized", {}).get("lm_head.weight")
    if q is None:
        return model.lm_head.weight.detach().float()
    from ..quant.formats import dequantize

    return dequantize(q.weight).float()


def build_runtime(hf, target, where):
    if hf.kind == "eagle":
        from ..propose.eagle import EagleHead
        from .eagle_net import EagleConfig, EagleNet

        try:
            net = EagleNet(EagleConfig(**hf.config))
        except TypeError as e:
            raise ConfigError("head", f"{where}: head config is malformed ({e})") from None
        _load_state(net, hf.state, where)
        m = target.model
        embed = m.embed_weight() if hasattr(m, "embed_weight") else m.embed_tokens.weight.detach().float()
        if net.config.draft_vocab_size is None:
            return EagleHead(net.eval().float(), embed, target_head_weight(m))
        from .vocab import ids_of

        ids = ids_of(net.d2t, net.t2d, net.config.vocab_size, str(where))
        return EagleHead(net.eval().float(), embed, net.lm_head.weight.detach(), ids)
    from ..propose.medusa import build_medusa

    return build_medusa(hf, target, where)


def _load_state(net: torch.nn.Module, state: dict[str, torch.Tensor], where) -> None:
    want = net.state_dict()
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    if missing or extra:
        raise ConfigError("head", f"{where}: weights do not match the head's layout "
                                  f"(missing {missing[:4]}, unexpected {extra[:4]})")
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in want.items() if state[k].shape != v.shape]
    if bad:
        raise ConfigError("head", f"{where}: weight shapes differ: {'; '.join(bad[:4])}")
    net.load_state_dict({k: v if k in ("d2t", "t2d") else v.float() for k, v in state.items()})
