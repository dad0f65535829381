"""Errors a user can act on. Each carries an OpenAI-style type/param/code so the HTTP layer maps it 1:1."""

from __future__ import annotations


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose (never a bare traceback for bad input)."""

    error_type = "invalid_request_error"
    status_code = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequestError(PdserveError):
    """A request parameter is out of range or malformed."""


class UnknownNameError(InvalidRequestError, ValueError):
    """A setting names something that is not registered (a queue policy, an attention backend); the message lists
    what is. A ValueError to a Python caller, a one-line error on the command line."""


def check_choice(value, allowed, param: str) -> str:
    """`value` if it is one of `allowed`, else a one-line `UnknownNameError` naming the allowed ones."""
    if value not in allowed:
        raise UnknownNameError(f"unknown {param} {value!r}; choose from {', '.join(allowed)}", param=param)
    return value


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(PdserveError):
    error_type = "not_found_error"
    status_code = 404
    code = "model_not_found"


class NotFoundError(PdserveError):
    error_type = "not_found_error"
    status_code = 404
    code = "not_found"


class UnsupportedModelError(PdserveError):
    """The weights exist but describe an architecture, tokenizer or format pdserve does not run."""

    code = "unsupported_model"


def check_ttl(ttl_s) -> float:
    """A prewarm's time to live: a positive number of seconds, at most a day."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= 86400:
        raise InvalidRequestError(f"ttl_s must be a number of seconds in (0, 86400], got {ttl_s!r}", param="ttl_s")
    return float(ttl_s)
