"""Structured output, gateway side: what a request asks its answer to match, as one llguidance grammar that
travels in `SamplingParams.grammar` to the workers (`pdserve.model.grammar` masks the sampler with it).

Accepted, at most one per request (a 400 naming the fields otherwise):
* OpenAI's `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (any JSON object),
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (that schema);
* vLLM's `guided_json` (a schema, as an object or a string), `guided_regex`, `guided_choice` (a list of
  strings: the answer is exactly one of them), `guided_grammar` (a Lark grammar: llguidance's syntax), and
  the newer `structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}`.

JSON is generated compactly (`", "` and `": "` separators, no free whitespace): a small model given free
whitespace may emit newlines until max_tokens. A schema or pattern llguidance cannot compile is a 400.
"""

from __future__ import annotations

import json

from pdserve.errors import InvalidRequestError
from pdserve.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class Grammars:
    """Builds and checks grammars against the served model's tokenizer (loaded once, on first use)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll = None

    @property
    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance
            self._ll = llguidance.LLTokenizer(self._tokenizer.to_json(),
                                              eos_token=list(self._tokenizer.eos_token_ids) or None)
        return self._ll

    def for_request(self, req) -> str | None:
        """The grammar a request's fields ask for (None: unconstrained)."""
        extra = req.model_extra or {}
        asked = [(name, extra[name]) for name in (*GUIDED, "structured_outputs") if extra.get(name) is not None]
        fmt = getattr(req, "response_format", None)
        if fmt is not None and fmt.get("type") != "text":
            asked.append(("response_format", fmt))
        if not asked:
            return None
        if len(asked) > 1:
            raise InvalidRequestError(f"give one way to constrain the output, not {', '.join(n for n, _ in asked)}",
                                      param=asked[1][0])
        name, value = asked[0]
        nested = name == "response_format" and value.get("type") == "json_schema"
        return self.check(_build(name, value), "response_format.json_schema.schema" if nested else name)

    def json_schema(self, schema: dict, param: str) -> str:
        return self.check(_from_schema(schema, param), param)

    def check(self, grammar: str, param: str) -> str:
        import llguidance
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"{param}: the grammar does not compile: {error.strip()[:300]}", param=param)
        return grammar


def _build(name: str, value) -> str:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict) or len([k for k, v in value.items() if v is not None]) != 1:
            raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, grammar",
                                      param=name)
        key, inner = next((k, v) for k, v in value.items() if v is not None)
        if key not in ("json", "regex", "choice", "grammar"):
            raise InvalidRequestError(f"structured_outputs.{key} is not supported; use json, regex, choice or "
                                      "grammar", param=f"{name}.{key}")
        return _build("guided_" + key, inner)
    if name == "guided_json":
        return _from_schema(value, name)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise InvalidRequestError("guided_regex must be a non-empty string", param=name)
        import llguidance
        return llguidance.LLMatcher.grammar_from_regex(value)
    if name == "guided_choice":
        return choice_grammar(value, name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError("guided_grammar must be a Lark grammar (a non-empty string)", param=name)
    import llguidance
    return llguidance.LLMatcher.grammar_from_lark(value)


def _response_format(fmt: dict) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        return _from_schema({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                  param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequestError("response_format.json_schema must be an object with a name and a schema",
                                  param="response_format.json_schema")
    return _from_schema(spec.get("schema", {}), "response_format.json_schema.schema")


def _from_schema(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    import llguidance
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except Exception as e:  # (whatever llguidance's compiler raises about the schema)
        raise InvalidRequestError(f"{param}: unsupported JSON schema: {str(e)[:300]}", param=param) from None


def choice_grammar(choices, param: str) -> str:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
    import llguidance
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
