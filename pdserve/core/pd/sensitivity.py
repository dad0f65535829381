"""Sensitivity labels of KV and the protection each gets in transit (issue 40): torch-, IO- and crypto-free.

A request's prompt KV carries one label, `public`, `internal` or `secret`: the deployment's default
(`--kv-sensitivity`, `internal`: KV is a user's context, so it is not public unless someone says so), else its
API key's (a column of `--api-keys-file`), else the request's own extension field `kv_sensitivity`
(`resolve`: the request's wins, then the key's, then the deployment's). It travels with the request to the
prefill worker (the `Prefill` command, `Outbound.sensitivity`) and with every chunk (`label` in its header).

What a record gets on a path (`protection`), by label and whether the path crosses hosts:

    label      same host   crosses hosts
    public     plain       mac   (authenticated, not encrypted)
    internal   plain       aead  (encrypted and authenticated)
    secret     aead        aead

Control records (no payload: done, alive, fail) get `mac` across hosts, `plain` on one. The receiver holds a
record to the same rule (`acceptable`): weaker than its label and path ask for is refused. The crypto itself is
`pdserve.transfer.kv_seal`.
"""

from __future__ import annotations

from pdserve.errors import check_choice

LABELS = ("public", "internal", "secret")
DEFAULT = "internal"
MODES = ("plain", "mac", "aead")  # weakest first
FIELD = "kv_sensitivity"  # the request's extension field (and the flag's name)


def check_label(value, param: str = FIELD) -> str:
    """`value` if it is a label; else a one-line error naming `param`."""
    return check_choice(value, LABELS, param)


def resolve(request: str | None, key: str | None, deployment: str) -> str:
    """A request's label: its own field's, else its API key's, else the deployment's."""
    if request is not None:
        return check_label(request)
    return key if key is not None else deployment


def protection(label: str | None, crosses_hosts: bool) -> str:
    """The mode a record with `label` (None: a control record) travels in; an unknown label is `secret`."""
    if label is None:
        return "mac" if crosses_hosts else "plain"
    if label not in ("public", "internal"):
        return "aead"
    if not crosses_hosts:
        return "plain"
    return "aead" if label == "internal" else "mac"


def acceptable(mode: str, label: str | None, crosses_hosts: bool) -> bool:
    """Whether a record that arrived in `mode` is protected at least as its label and path ask."""
    return mode in MODES and MODES.index(mode) >= MODES.index(protection(label, crosses_hosts))
