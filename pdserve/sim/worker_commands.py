"""What a simulated worker does with each command for a request or a transfer (`pdserve.conductor.commands`,
the real worker's `pdserve.worker.worker_commands`): the request is made from the command's fields and
reaches the engine a control message's way later (a prefill: after the decode worker's reply to the gateway and
the gateway's command), at the engine's next step boundary. The simulator models no lease lapses and no
prewarm pins: `renew`, `redirect`, `unpin` and `peer_gone` are counted (`sim_ignored_commands`), not carried out.
"""

from __future__ import annotations

from pdserve.conductor.wire import (Abort, Generate, KvFailed, PeerGone, Prefill, Redirect, Renew, Reserve, Stage,
                                  Unpin, Warm)
from pdserve.core.sampling_params import SamplingParams
from pdserve.errors import PdserveError
from pdserve.sim.engine import SimEngine, SimRequest


class SimCommands:
    def __init__(self, conductor, engine: SimEngine) -> None:
        """`conductor`: the `SimConductor` whose flights, decode books, transfer map and staging the commands
        act on."""
        self.sim, self.engine = conductor, engine

    def _post(self, fn, delay_s: float | None = None) -> None:
        self.engine.post(fn, self.sim.control_s if delay_s is None else delay_s)

    def generate(self, cmd: Generate) -> None:
        f = self.sim.flights.get(cmd.rid)
        self._post(lambda: self._add(f, self._request(cmd)))

    def reserve(self, cmd: Reserve) -> None:
        f = self.sim.flights.get(cmd.rid)
        self._post(lambda: self._reserve(f, cmd))

    def prefill(self, cmd: Prefill) -> None:
        f = self.sim.flights.get(cmd.rid)
        if cmd.deadline_in_s is not None:
            f.deadline_s = self.sim.loop.now + cmd.deadline_in_s
        if cmd.read_in_s is not None:
            f.read_s = self.sim.loop.now + cmd.read_in_s
        add = lambda: self._add(f, self._request(cmd, prefill_only=True), cmd)  # noqa: E731
        self._post(lambda: self.sim.staging.add_prefill(self.engine, cmd.rid, add),
                   self.sim.links.latency_s + 2 * self.sim.control_s)

    def stage(self, cmd: Stage) -> None:
        self._post(lambda: self.sim.staging.stage(self.engine, self._request(cmd, prefill_only=True)))

    def warm(self, cmd: Warm) -> None:
        self._post(lambda: self.sim.staging.warm(self.engine, cmd.rid, cmd.prompt, self.sim.loop.now))

    def abort(self, cmd: Abort) -> None:
        self._post(lambda: self._abort(cmd.rid))

    def kv_failed(self, cmd: KvFailed) -> None:
        self._post(lambda: self._kv_failed(cmd.xfer))

    def renew(self, cmd: Renew) -> None:
        self._ignored(cmd)

    def redirect(self, cmd: Redirect) -> None:
        self._ignored(cmd)

    def unpin(self, cmd: Unpin) -> None:
        self._ignored(cmd)

    def peer_gone(self, cmd: PeerGone) -> None:
        self._ignored(cmd)

    # ---- at the engine ---------------------------------------------------------------------------------------
    def _ignored(self, cmd) -> None:
        self.sim.counts[("sim_ignored_commands", (("command", cmd.kind),))] += 1

    def _request(self, cmd, prefill_only: bool = False) -> SimRequest:
        """A command's request, as a worker makes it (`LLMEngine.make_request`), stamped with the simulated
        time it reaches its worker (the real worker stamps its own clock)."""
        return SimRequest(cmd.rid, cmd.prompt, SamplingParams(**cmd.params), arrival_s=self.sim.loop.now,
                          priority=cmd.priority, prefill_only=prefill_only, service_tier=cmd.tier or "default")

    def _add(self, f, req: SimRequest, prefill: Prefill | None = None) -> None:
        """`prefill`: the command of a prompt whose KV this engine sends (its transfer opens as it is added)."""
        if f.finished:
            return
        try:
            self.engine.scheduler.add_request(req)
        except PdserveError as e:
            self.sim.fail(f, str(e))
            return
        if prefill is not None:
            self.sim.kv.open(self.engine.name, f, prefill)

    def _reserve(self, f, cmd: Reserve) -> None:
        """The decode worker makes the request when the reservation reaches it and queues it in its books."""
        if not f.finished:
            f.xfer, self.sim.xfers[cmd.xfer] = cmd.xfer, cmd.rid
        try:
            self.sim.books[self.engine.name].reserve(self._request(cmd), cmd.xfer)
        except PdserveError as e:
            if not f.finished:
                self.sim.fail(f, str(e))

    def _abort(self, rid: str) -> None:
        self.engine.engine.abort([rid])
        self.sim.staging.abort(self.engine, rid)
        self.sim.kv.abort(self.engine.name, rid)
        books = self.sim.books.get(self.engine.name)
        if books is not None:
            books.abort(rid)

    def _kv_failed(self, xfer: str) -> None:
        """The conductor says this KV will not come: the prompt is recomputed here."""
        req = self.engine.scheduler.requests.get(self.sim.xfers.get(xfer))
        if req is not None and req.status.name == "WAITING_FOR_KV":
            self.engine.scheduler.kv_failed(req.request_id)
