"""What a worker does with each command of the conductor, named once for both clocks.

Every command a worker takes for a request or a transfer (`pdserve.conductor.wire`) is a method of
`CommandTarget`, named after the command's kind, and `carry_out` calls the one a command names. The real
worker (`pdserve.worker.worker_commands.WorkerCommands`: its engine, prefill and decode sides) and each
simulated worker (`pdserve.sim.worker_commands.SimCommands`) implement every one of them, so a command the
core starts sending reaches both (a test checks that each implements all of `REQUEST_COMMANDS`). The commands of
a worker process's membership (shutdown, welcome, release, leave, refused) are the real worker's alone.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.conductor.wire import (Abort, Generate, KvFailed, PeerGone, Prefill, Redirect, Renew, Reserve, Stage,
                                  Unpin, Warm)

REQUEST_COMMANDS = (Generate, Reserve, Prefill, Stage, Warm, Abort, KvFailed, Renew, Redirect, Unpin, PeerGone)


class CommandTarget(Protocol):
    def generate(self, cmd: Generate) -> None: ...  # colocated: the whole request here
    def reserve(self, cmd: Reserve) -> None: ...  # decode: blocks for the prompt, then its KV
    def prefill(self, cmd: Prefill) -> None: ...  # prefill: compute the prompt, send its KV
    def stage(self, cmd: Stage) -> None: ...  # prefill: compute the prompt ahead, keep its KV
    def warm(self, cmd: Warm) -> None: ...  # prefill: compute a hot prefix ahead
    def abort(self, cmd: Abort) -> None: ...
    def kv_failed(self, cmd: KvFailed) -> None: ...  # decode: the KV will not come, recompute
    def renew(self, cmd: Renew) -> None: ...  # decode: a lapsed lease starts over
    def redirect(self, cmd: Redirect) -> None: ...  # decode: the KV comes anew from another prefill worker
    def unpin(self, cmd: Unpin) -> None: ...  # a prewarm pin ends
    def peer_gone(self, cmd: PeerGone) -> None: ...  # prefill: a decode worker is gone


def carry_out(cmd, target: CommandTarget) -> None:
    """Call the method of `target` that `cmd` names."""
    getattr(target, cmd.kind)(cmd)
