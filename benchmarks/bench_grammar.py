"""xgrammar vs llguidance on the default model's tokenizer (issue 18: measure both, pick one).

For each grammar (any JSON object, a JSON schema, a regex, a choice): the cold compile time, and the time per
output token of what the sampler needs every step (the next token's bitmask, then advancing the matcher by the
chosen token), walking a valid answer's tokens. Medians over `--repeat` runs.

    .venv/bin/python benchmarks/bench_grammar.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve.model.loader import resolve_model_dir
from pdserve.server.app_runtime import _tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "tags": ["math", "poetry"],
                     "address": {"city": "London", "zip": "W1"}})
CASES = [("json_object", None, ANSWER), ("json_schema", SCHEMA, ANSWER),
         ("regex", r"\d{3}-\d{4} [A-Z][a-z]+", "555-1234 Smith"),
         ("choice", ["positive", "negative", "neutral"], "negative")]


class LLG:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.numpy
        self.llg, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.LLTokenizer(tok.to_json(), eos_token=tok.eos_token_ids[0])
        self.vocab = self.tok.vocab_size

    def compile(self, kind, spec):
        g = self.llg.LLMatcher
        if kind == "json_object":
            grammar = g.grammar_from_json_schema({"type": "object"})
        elif kind == "json_schema":
            grammar = g.grammar_from_json_schema(spec)
        elif kind == "regex":
            grammar = g.grammar_from_regex(spec)
        else:
            grammar = g.grammar_from_regex("(" + "|".join(spec) + ")")
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled)
        assert not m.is_error(), m.get_error()
        return m, self.np.allocate_token_bitmask(1, self.vocab)

    def step(self, state, token: int) -> None:
        m, mask = state
        self.np.fill_next_token_bitmask(m, mask, 0)
        assert (mask[0, token // 32] >> (token % 32)) & 1, "the answer's token is masked out"
        assert m.consume_token(token), m.get_error()


class XGR:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar
        self.xgr = xgrammar
        vocab = [tok.id_to_token(i) or "" for i in range(tok.vocab_size)]
        self.info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                           stop_token_ids=list(tok.eos_token_ids))
        self.vocab = tok.vocab_size

    def compile(self, kind, spec):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_regex("(" + "|".join(spec) + ")")

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)

    def step(self, state, token: int) -> None:
        m, mask = state
        m.fill_next_token_bitmask(mask)
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, "the answer's token is masked out"
        assert m.accept_token(token)


def measure(engine, tok, repeat: int) -> list[dict]:
    rows = []
    for kind, spec, answer in CASES:
        tokens = tok.encode(answer, add_special_tokens=False)
        compiles, per_token = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            compiled = engine.compile(kind, spec)
            state = engine.matcher(compiled)
            compiles.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t in tokens:
                engine.step(state, t)
            per_token.append((time.perf_counter() - t0) / len(tokens))
        rows.append({"engine": engine.name, "grammar": kind, "tokens": len(tokens),
                     "compile_ms": statistics.median(compiles) * 1e3,
                     "mask_us_per_token": statistics.median(per_token) * 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tok = _tokenizer(str(resolve_model_dir(None)))
    rows = []
    for cls in (LLG, XGR):
        t0 = time.perf_counter()
        engine = cls(tok)
        setup = (time.perf_counter() - t0) * 1e3
        print(f"{cls.name}: tokenizer set-up {setup:.0f} ms")
        rows += measure(engine, tok, args.repeat)
    print(f"{'engine':<11} {'grammar':<12} {'tokens':>6} {'compile ms':>11} {'mask+advance us/token':>22}")
    for r in rows:
        print(f"{r['engine']:<11} {r['grammar']:<12} {r['tokens']:>6} {r['compile_ms']:>11.1f} "
              f"{r['mask_us_per_token']:>22.1f}")


if __name__ == "__main__":
    main()
