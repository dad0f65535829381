"""Text <-> tokens for a Hugging Face model directory, and its chat template. No torch."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.errors import InvalidRequestError, ModelNotFoundError


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, special_tokens: dict[str, str],
                 eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token / eos_token text, as the template expects them
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {str(path)!r}")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token") if cfg.get(k)}
        eos_ids = tuple(eos_token_ids)
        if "eos_token" in special:
            eos_id = tok.token_to_id(special["eos_token"])
            if eos_id is not None and eos_id not in eos_ids:
                eos_ids += (eos_id,)
        return cls(tok, template, special, eos_ids)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (a grammar engine builds its token tables from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def template_takes_tools(self) -> bool:
        """The chat template renders a `tools` argument (function calling) itself."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if self._template is None:
            raise InvalidRequestError("this model has no chat template; use a completion prompt instead",
                                      param="messages")
        _validate_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}), **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
