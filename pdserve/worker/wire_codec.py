"""The control plane's messages on the sockets: `pdserve.conductor.wire` messages as msgpack maps."""

from __future__ import annotations

import msgpack

from pdserve.conductor.wire import WireError, from_dict, to_dict


def pack(msg) -> bytes:
    return msgpack.packb(to_dict(msg))


def unpack(raw: bytes):
    """The message in `raw`; `WireError` for bytes that are no message."""
    try:
        d = msgpack.unpackb(raw)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"not msgpack: {e}") from e
    return from_dict(d)
