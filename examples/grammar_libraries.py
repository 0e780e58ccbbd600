"""Compare the grammar libraries leaplm could build structured output on: llguidance, xgrammar, outlines-core.

For a tokenizer (the embedded target's, or a GGUF file's as leaplm loads it) it measures, per library: building its
view of the tokenizer, compiling a JSON Schema, the token mask at every position of a valid document (median, mean
and 90th percentile over the positions, one thread) and the forced-token query; then which JSON Schema keywords each
compiles, and whether one it compiles is enforced or ignored (a document the keyword forbids is fed to the matcher).

    pip install llguidance xgrammar outlines-core     # leaplm depends on llguidance alone
    python examples/grammar_libraries.py                       # the embedded target's tokenizer
    python examples/grammar_libraries.py ~/.cache/leaplm/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"],
                  "address": {"city": "London", "zip": "12345"}})


def _obj(**kw) -> dict:
    return {"type": "object", "properties": {"x": kw}, "required": ["x"]}


# keyword -> (schema, a document the keyword forbids: accepted means the library ignored the keyword)
COVERAGE = {
    "pattern": (_obj(type="string", pattern="^[a-z]{3}$"), '{"x": "ABCD"}'),
    "format: email": (_obj(type="string", format="email"), '{"x": "not an email"}'),
    "minimum/maximum": (_obj(type="integer", minimum=3, maximum=7), '{"x": 9}'),
    "minItems/maxItems": (_obj(type="array", items={"type": "integer"}, maxItems=1), '{"x": [1, 2]}'),
    "anyOf": (_obj(anyOf=[{"type": "integer"}, {"type": "boolean"}]), '{"x": "s"}'),
    "allOf": (_obj(allOf=[{"type": "integer"}, {"minimum": 2}]), '{"x": 1}'),
    "$ref (recursive)": ({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}, "additionalProperties": False}}, "$ref": "#/$defs/n"}, '{"c": [{"d": 1}]}'),
    "uniqueItems": (_obj(type="array", items={"type": "integer"}, uniqueItems=True), '{"x": [1, 1]}'),
    "contains": (_obj(type="array", items={"type": "integer"}, contains={"const": 5}), '{"x": [1]}'),
    "not": (_obj(**{"not": {"type": "string"}}), '{"x": "s"}'),
    "if/then/else": (_obj(**{"if": {"type": "integer"}, "then": {"minimum": 1}, "else": {"type": "string"}}),
                     '{"x": 0}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}"),
}


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path is None:
        from leaplm.models import embedded

        return AutoTokenizer.from_pretrained(embedded.default_target())
    from pathlib import Path

    p = Path(path).expanduser()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, V):
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch as lt
        self.llg, self.lt, self.V = llg, lt, V
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False})
        err, msgs = self.llg.LLMatcher.validate_grammar_with_warnings(g, self.lltok)
        if err or msgs:
            raise ValueError("; ".join(msgs))
        return g

    def matcher(self, g):
        return self.llg.LLMatcher(self.lltok, g, log_level=0)

    def mask(self, m, bm):
        self.lt.fill_next_token_bitmask(m, bm)

    def bitmask(self):
        return self.lt.allocate_token_bitmask(1, self.V)

    def consume(self, m, t) -> bool:
        return m.consume_token(t)

    def forced(self, m):
        return m.compute_ff_tokens()

    def accepts(self, m, ids) -> bool:
        return m.validate_tokens(ids) == len(ids) and m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, V):
        import xgrammar as xgr
        self.xgr, self.V = xgr, V
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, g):
        return self.xgr.GrammarMatcher(g)

    def mask(self, m, bm):
        m.fill_next_token_bitmask(bm)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.V)

    def consume(self, m, t) -> bool:
        return m.accept_token(t)

    def forced(self, m):
        return m.find_jump_forward_string()

    def accepts(self, m, ids) -> bool:
        return all(m.accept_token(t) for t in ids) and m.is_completed()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, V):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex, self.V = oc, build_regex_from_schema, V
        eos = tok.eos_token_id
        vocab: dict[str, list[int]] = {}
        for s, i in tok.get_vocab().items():
            if i != eos:
                vocab.setdefault(tok.convert_tokens_to_string([s]), []).append(i)
        self.vocab = oc.Vocabulary(eos, vocab)

    def compile(self, schema):
        return self.oc.Index(self.regex(json.dumps(schema)), self.vocab)

    def matcher(self, g):
        return self.oc.Guide(g)

    def mask(self, m, bm):
        m.write_mask_into(bm.data_ptr(), bm.numel(), 4)

    def bitmask(self):
        return torch.zeros((self.V + 31) // 32, dtype=torch.int32)

    def consume(self, m, t) -> bool:
        m.advance(t)
        return True

    def forced(self, m):
        return None

    def accepts(self, m, ids) -> bool:
        try:
            for t in ids:
                m.advance(t)
        except Exception:  # noqa: BLE001 - outlines-core raises on a refused token
            return False
        return m.is_finished()


def main() -> None:
    tok = load_tokenizer(sys.argv[1] if len(sys.argv) > 1 else None)
    V = len(tok)
    ids = tok.encode(DOC, add_special_tokens=False)
    print(f"tokenizer: {V} tokens; document: {len(ids)} tokens; torch threads 1")
    libs = []
    for cls in (Llguidance, Xgrammar, OutlinesCore):
        try:
            t = time.perf_counter()
            lib = cls(tok, V)
            lib.tok_s = time.perf_counter() - t
            libs.append(lib)
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    print(f"\n{'library':14} {'tokenizer ms':>12} {'compile ms':>10} {'mask us: median':>16} {'mean':>7} {'p90':>7} "
          f"{'forced query us':>16}")
    for lib in libs:
        t = time.perf_counter()
        g = lib.compile(SCHEMA)
        compile_s = time.perf_counter() - t
        bm = lib.bitmask()
        times, ff = [], []
        for _ in range(5):
            m = lib.matcher(g)
            for tkn in ids:
                times.append(timed(lambda: lib.mask(m, bm)))
                ff.append(timed(lambda: lib.forced(m)))
                assert lib.consume(m, tkn)
        times.sort()
        ffs = f"{statistics.median(ff) * 1e6:16.1f}" if lib.forced(lib.matcher(g)) is not None else f"{'-':>16}"
        print(f"{lib.name:14} {lib.tok_s * 1e3:12.0f} {compile_s * 1e3:10.1f} {statistics.median(times) * 1e6:16.1f} "
              f"{statistics.mean(times) * 1e6:7.1f} {times[int(0.9 * len(times))] * 1e6:7.1f} {ffs}")
    print(f"\n{'JSON Schema keyword':20} " + " ".join(f"{lib.name:>24}" for lib in libs))
    for name, (schema, bad) in COVERAGE.items():
        cells = []
        for lib in libs:
            try:
                g = lib.compile(schema)
            except Exception as e:  # noqa: BLE001 - each library has its own error types
                cells.append(("refused: " + str(e).split("\n")[0])[:24])
                continue
            bad_ids = tok.encode(bad, add_special_tokens=False)
            cells.append("IGNORED" if lib.accepts(lib.matcher(g), bad_ids) else "enforced")
        print(f"{name:20} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
