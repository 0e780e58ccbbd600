"""The heads the proposers run (propose/eagle.py, propose/medusa.py): a trained network with the target tensors it
reuses, built from a head file for its target (heads/loader.py finds and checks the file)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .eagle_net import EagleConfig, EagleNet
from .medusa_net import MedusaConfig, MedusaNet


@dataclass
class EagleHead:
    """A trained head with the target tensors it reuses (shared by every request of an engine)."""
    net: EagleNet
    embed: torch.Tensor      # [V, hid] the target's embedding
    lm_head: torch.Tensor    # [V, hid] the target's output projection, or [N, hid] the head's own (draft vocab)
    vocab_ids: torch.Tensor | None = None   # [N] target id of each lm_head row (reduced draft vocabulary)

    @torch.inference_mode()
    def run(self, cache: "HeadCache", start: int, feats: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
        """Entries (feats [T, hid], tokens [T]) at positions pos [T] written to cache slots [start, start + T);
        mask [T, start + T] bool (None: all of [0, start) and causal among the new ones).
        Returns the predicted features [T, hid]."""
        net = self.net
        T = tokens.numel()
        x = net.fuse(F.embedding(tokens, self.embed), feats).unsqueeze(0)            # [1, T, hid]
        q, k, v = net.qkv(x, pos.unsqueeze(0))
        cache.k[:, :, start: start + T] = k
        cache.v[:, :, start: start + T] = v
        if mask is None:
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        return net.finish(x, q, cache.k[:, :, : start + T], cache.v[:, :, : start + T], mask)[0]

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [T, hid] -> logits [T, N] over the head's rows (N = V without a draft vocabulary; row j is
        target token vocab_ids[j]). Drafting ranks and normalises over these N rows alone: q is 0 outside them,
        so a full [T, V] row is built only where a caller needs q over V (to_vocab)."""
        return F.linear(feats, self.lm_head)

    def to_vocab(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """rows [T, N] over the head's rows -> [T, V], `fill` outside the draft vocabulary."""
        if self.vocab_ids is None:
            return rows
        full = rows.new_full((rows.shape[0], self.embed.shape[0]), fill)                # [T, V]
        return full.index_copy_(1, self.vocab_ids, rows)

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Head row indices [n] -> target token ids [n]."""
        return rows if self.vocab_ids is None else self.vocab_ids[rows]


class HeadCache:
    def __init__(self, net: EagleNet, max_len: int):
        c = net.config
        self.k = torch.zeros(1, c.num_key_value_heads, max_len, c.head_dim)
        self.v = torch.zeros_like(self.k)


@dataclass
class MedusaHeads:
    net: MedusaNet
    lm_head: torch.Tensor    # [V, hid] the target's

    @torch.inference_mode()
    def logits(self, feat: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """feat [hid] -> [n, V] of the first n heads (default: all); the heads a step does not use cost nothing."""
        return F.linear(self.net(feat, n), self.lm_head)


def target_head_weight(model) -> torch.Tensor:
    """[V, hid] fp32: the target's output projection as it computes it. Under --quantization the fp weight is
    freed (quant/apply.py) and the quantized one is dequantized here, so heads see the quantized target's head."""
    if hasattr(model, "head_weight"):                   # libllama (models/llamacpp/model.py): read from the file
        return model.head_weight()
    q = getattr(model, "quantized", {}).get("lm_head.weight")
    if q is None:
        return model.lm_head.weight.detach().float()
    from ..quant.formats import dequantize

    return dequantize(q.weight).float()


def build_runtime(hf, target, where) -> EagleHead | MedusaHeads:
    """The runtime head for a checked head file `hf` (heads/formats.py read_any) on `target`."""
    if hf.kind == "eagle":
        try:
            net = EagleNet(EagleConfig(**hf.config))
        except TypeError as e:
            raise ConfigError("head", f"{where}: head config is malformed ({e})") from None
        load_weights(net, hf.state, where)
        m = target.model
        embed = m.embed_weight() if hasattr(m, "embed_weight") else m.embed_tokens.weight.detach().float()
        if net.config.draft_vocab_size is None:
            return EagleHead(net.eval().float(), embed, target_head_weight(m))
        from .vocab import ids_of

        ids = ids_of(net.d2t, net.t2d, net.config.vocab_size, str(where))
        return EagleHead(net.eval().float(), embed, net.lm_head.weight.detach(), ids)
    try:
        net = MedusaNet(MedusaConfig(**hf.config))
    except TypeError as e:
        raise ConfigError("head", f"{where}: head config is malformed ({e})") from None
    load_weights(net, hf.state, where)
    return MedusaHeads(net.eval().float(), target_head_weight(target.model))


def load_weights(net: torch.nn.Module, state: dict[str, torch.Tensor], where) -> None:
    """A head's weights into its network; a layout or shape that differs is refused naming `where`."""
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
