"""The per-request halves of a step, shared by Engine (one request) and BatchScheduler (many rows).

  new_request   build a request's state: stop ids, detokenizer, stats, generator, presence
  commit        stage 4 for one row: append the verified tokens (cut at a stop token, a stop string or
                max_new_tokens), move that row's cache length, record stats and logprobs
  finish_chunk  the last chunk of a request: release the held-back text, attach finish_reason and stats
  verify_commit stages 3 and 4 for one row of a step (a tree row scored first, by its own forward): the verifier
                its request runs (engine/verification.py), what the proposer learns, then commit

Only `commit` changes state. Neither the engine nor the scheduler re-implements these.
"""
from __future__ import annotations

import logging
import secrets
import time

import torch

from ..config import SamplingParams
from ..propose.base import Proposal
from ..sampling import make_generator
from ..sampling.positional import check_seed, fold_seed
from ..verify import VerifyResult
from .constrain import RowConstraint, masked
from .detok import IncrementalDetokenizer
from .kpolicy.policy import RowStep
from .observer import StepObserver
from .request import Request, StreamChunk, TokenLogprob
from .row import Row, RowOutput, engine_error
from .scoring import ChainScores
from .stats import GenerationStats, StepClock
from .tree_step import extra_logits, score_tree
from .verification import request_verifier, verify_argmax, verify_chain

log = logging.getLogger(__name__)


def new_request(ids: list[int], params: SamplingParams, *, tokenizer, eos_token_ids: list[int],
                vocab_size: int, device, method: str, k: int, verifier: str = "auto") -> Request:
    """A fresh Request for prompt `ids`; `k` is the configured K recorded in its stats (0 without a proposer);
    verifier: the engine's default for sampled requests that leave it to 'auto' (SpecConfig.verifier)."""
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_token_ids)
    seed = None
    if not params.greedy:   # all 64 bits of the seed fix the draws; an unseeded request gets a random one
        seed = check_seed(params.seed) if params.seed is not None else secrets.randbits(64)
    presence = None
    if params.repetition_penalty != 1.0:
        presence = torch.zeros(vocab_size, dtype=torch.bool, device=device)      # [V]
        presence[torch.tensor(ids, device=presence.device)] = True
    return Request(
        prompt_ids=ids, params=params, tokens=list(ids), stop_ids=frozenset(stop_ids),
        detok=IncrementalDetokenizer(tokenizer, params.stop),
        stats=GenerationStats(method, k, prompt_tokens=len(ids)),
        generator=None if seed is None else make_generator(fold_seed(seed), device), seed=seed,
        presence=presence, logprobs=[] if params.logprobs is not None else None,
        verifier=request_verifier(params, verifier),
        explicit_verifier=(params.verifier, verifier) != ("auto", "auto"))


def commit(req: Request, result: VerifyResult, logits: torch.Tensor, drafted: int, cache,
           row: int = 0, forced: bool = False, predicted: bool = False) -> StreamChunk:
    """Append the verified tokens, cut at a stop token, stop string or max_new_tokens; move row's cache length.

    What is kept equals plain decoding token for token: nothing after the token that ended the request is returned,
    counted or cached (the cache advances by the tokens kept, so it holds every committed token but the last).
    logits [T, V]: the raw target logits of the block just scored for this row (for logprobs).
    forced: the drafts were the grammar's forced tokens (counted apart from the proposer's in the stats).
    """
    if result.path is not None:
        cache.compact([0] + [i + 1 for i in result.path], row)
    emitted = result.tokens[: req.remaining]
    finish = "length" if len(emitted) == req.remaining else None
    for i, t in enumerate(emitted):
        if t in req.stop_ids:
            emitted, finish = emitted[:i], "stop"   # the stop token itself is not returned
            break
    if req.grammar is not None:
        t0 = time.perf_counter()
        kept = req.grammar.advance(emitted)
        req.stats.grammar_s += time.perf_counter() - t0
        if req.grammar.stopped:                           # the grammar is complete: nothing after it is output
            emitted, finish = emitted[:kept], "stop"
    if req.detok.stop and len(emitted) > 1:
        # one token at a time, as plain decoding adds them: the token that completes a stop string is the last kept
        text = ""
        for j, t in enumerate(emitted):
            text += req.detok.add([t])
            if req.detok.stopped:
                emitted = emitted[: j + 1]
                break
    else:
        text = req.detok.add(emitted)
    if req.detok.stopped:
        finish = "stop"
    cache.advance(len(emitted), row)
    if forced:
        req.stats.record_step(0, 0, len(emitted))
        req.stats.forced_tokens += drafted
        req.stats.forced_accepted += result.accepted
    else:
        req.stats.record_step(drafted, result.accepted, len(emitted))
    if predicted:
        kept = min(result.accepted, len(emitted))
        req.stats.accepted_prediction_tokens += kept
        req.stats.rejected_prediction_tokens += drafted - kept
    if req.logprobs is not None and emitted:
        req.logprobs.extend(token_logprobs(logits, result, emitted, req.params.logprobs or 0))
    req.tokens.extend(emitted)
    if req.presence is not None and emitted:
        req.presence[torch.tensor(emitted, device=req.presence.device)] = True
    req.finish_reason = finish
    return StreamChunk(text, emitted, logprobs=req.logprobs[-len(emitted):] if req.logprobs and emitted else None)


def verify_commit(model, cache, i: int, r: Row, p: Proposal | None, scored: ChainScores, clock: StepClock,
                  observer: StepObserver, rc: RowConstraint | None = None) -> tuple[RowOutput, RowStep | None]:
    """Stages 3 and 4 for row i of cache (a tree row scored here first, over its batch-1 view; a constrained row, rc,
    verified against its masked logits). Returns its output and what it did (None: it failed, its error in the
    output)."""
    out = RowOutput(r)
    d = p.k if p is not None else 0
    t0 = time.perf_counter()
    try:
        if p is not None and p.parents is not None:
            tree = score_tree(model, cache if cache.batch_size == 1 else cache.row_view(i), r.req, p, r.proc,
                              r.reads_hidden, r.proposer.samples,
                              constrain=(lambda x: masked(x, rc)) if rc is not None else None)
            observer.observe_forward(1, tree.block_len, tree.score_s)
            result, row_logits, row_hidden, score_s = tree.result, tree.logits, tree.hidden, tree.score_s
            kept = [0] + [j + 1 for j in result.path]
        elif scored.logits is None:                  # nothing reads its logits: the target's argmax alone
            row_logits = None
            result = verify_argmax(p, scored.argmax[i, : 1 + d])                         # [1 + k_i]
            row_hidden, kept, score_s = None, list(range(1 + result.accepted)), 0.0
        else:
            row_logits = scored.logits[i, : 1 + d]                                        # [1 + k_i, V]
            result = verify_chain(r.req, p, r.proc, masked(row_logits, rc) if rc is not None else row_logits)
            row_hidden = scored.hidden[i] if scored.hidden is not None else None
            kept, score_s = list(range(1 + result.accepted)), 0.0
        t1 = time.perf_counter()
        if r.reads_hidden:              # the target's features of the committed block tokens
            r.proposer.observe_hidden(len(r.req.tokens) - 1, row_hidden[kept])
        forced = rc is not None and rc.forced                        # the grammar's drafts, not the proposer's
        if p is not None and not forced:
            r.proposer.observe(p, result, extra_logits(p, row_logits))
        out.chunk = commit(r.req, result, row_logits, d, cache, row=i, forced=forced,
                           predicted=p is not None and p.predicted)
        clock.row(r.req.stats, score_s, t1 - t0 - score_s, time.perf_counter() - t1)
    except Exception as e:  # noqa: BLE001 - one request's failure is its own
        log.exception("a request failed in a step")
        out.error = engine_error(e)
        return out, None
    if forced:                                       # nothing the row's proposer drafted: not its acceptance
        return out, RowStep(0, 0, 1)
    n = row_logits.shape[0] if row_logits is not None else 1 + d
    return out, RowStep(d, result.accepted, n, p.match if p is not None else None, row_logits)


def finish_chunk(req: Request, chunk: StreamChunk) -> StreamChunk:
    """When req has finished: release the text held back and mark chunk as the last one."""
    if req.finish_reason is not None:
        chunk.text += req.detok.flush()
        chunk.finish_reason, chunk.stats = req.finish_reason, req.stats
    return chunk


def token_logprobs(logits: torch.Tensor, result: VerifyResult, emitted: list[int], top: int) -> list[TokenLogprob]:
    """The target's raw log-probabilities of the emitted tokens; logits [T, V] of the block just scored."""
    rows = [0] + [i + 1 for i in result.path] if result.path is not None else list(range(len(emitted)))
    lp = torch.log_softmax(logits[rows[: len(emitted)]].float(), -1)          # [n, V]
    chosen = lp.gather(1, torch.tensor(emitted, device=lp.device).view(-1, 1)).view(-1).tolist()
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in emitted]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(emitted, chosen, tops)]
