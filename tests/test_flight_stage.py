"""A request's stage in the conductor core (`pdserve.conductor.flight_state.Stage`): every move its table allows
(`TRANSITIONS`) is reached by the core's own flows, one event from a request in the stage it starts from, and
a move the table does not allow raises."""

from __future__ import annotations

import pytest

from pdserve.conductor.conductor_core import ConductorCore
from pdserve.conductor.flight_state import TRANSITIONS, FlightState, IllegalTransition, Stage
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.conductor.wire import Ready

BS = 16
PROMPT = list(range(100, 140))  # 3 blocks
S = Stage


def _core(mode: str = "pd", num_prefill: int = 2, num_decode: int = 2, stage_blocks: int = 0) -> ConductorCore:
    """`stage_blocks`: what each prefill worker may keep staged (0: no staging)."""
    core = ConductorCore(mode, make_routing_policy("least-loaded"), idle_prewarm=False)
    roles = ["colocated"] if mode == "colocated" else ["prefill"] * num_prefill + ["decode"] * num_decode
    for i, role in enumerate(roles):
        name = f"{role}-{i}"
        core.add_worker(name, role)
        core.worker_ready(name, Ready(name, role, block_size=BS, stage_blocks=stage_blocks if role == "prefill" else 0))
    return core


def _arrive(core: ConductorCore, rid: str = "a") -> FlightState:
    core.arrive(rid, PROMPT, {"max_tokens": 4}, 0.0)
    return core.flights[rid]


# ---- events ----------------------------------------------------------------------------------------------
def _reserved(needs_prefill: bool):
    return lambda core, f: core.reserved(f.rid, f.xfer, needs_prefill, "addr", 0)


def _reserve_waiting(core, f):
    core.reserve_waiting(f.rid, f.xfer)


def _staged(ok: bool):
    return lambda core, f: core.staged(f.rid, ok)


def _prefilled(core, f):
    core.prefilled(f.rid, 1.0)


def _first_token(core, f):
    core.token(f.rid, 0, False, 1.0, 7)


def _abort(core, f):
    core.abort(f.rid)


def _prefill_died(core, f):
    core.worker_died(f.prefill, 1.0)


def _stalled_then_reserved(core, f):
    core.workers[f.prefill].stalled = True  # its lease lapsed on another transfer
    _reserved(True)(core, f)


def _ready_again(core, f):
    name = "colocated-0" if core.books.mode == "colocated" else "decode-2"
    core.worker_ready(name, Ready(name, name.split("-")[0], block_size=BS))


# ---- a request brought to each stage (on a core of its own) --------------------------------------------------
def _after(setup, *events):
    core, f = setup()
    for event in events:
        event(core, f)
    return core, f


def reserving(core=None):
    core = core or _core()
    return core, _arrive(core)


def waiting_room():
    return _after(reserving, _reserve_waiting)


def staging():  # (its prefill worker is idle: it stages the prompt at once)
    return _after(lambda: reserving(_core(stage_blocks=64)), _reserve_waiting)


def staged():
    return _after(staging, _staged(True))


def dispatched():
    return _after(reserving, _reserved(True))


def prefilled():
    return _after(dispatched, _prefilled)


def local_prefill():
    return _after(reserving, _reserved(False))


def decoding():
    return _after(local_prefill, _first_token)


def redirected():
    """Dispatched, then its prefill worker died: moved to the other one, which it waits for."""
    return _after(dispatched, _prefill_died)


def orphaned(mode: str = "pd"):
    """Its only decode (colocated) worker died and is being restarted."""
    core = _core(mode, num_decode=1)
    f = _arrive(core)
    core.worker_died(f.decode, 1.0, restarting=True)
    (f,) = core.recovery.orphans
    return core, f


def _waiting_behind_another():
    """Waiting for room while its only prefill worker computes prompt "b" (so it stages nothing yet)."""
    core = _core(num_prefill=1, stage_blocks=64)
    _reserved(True)(core, _arrive(core, "b"))
    return _after(lambda: reserving(core), _reserve_waiting)


def _new(mode):
    return _core(mode), FlightState("a", PROMPT, {"max_tokens": 4}, "default", 0.0)


def _arrives(core, f):
    core.arrive(f.rid, PROMPT, {"max_tokens": 4}, 0.0)


# (from, to) -> (a request in `from`, the event that moves it to `to`)
MOVES = {
    (S.NEW, S.RESERVING): (lambda: _new("pd"), _arrives),
    (S.NEW, S.LOCAL_PREFILL): (lambda: _new("colocated"), _arrives),
    (S.NEW, S.ORPHANED): (lambda: _new("pd"), None),  # (the moved copy: `orphaned`)
    (S.ORPHANED, S.RESERVING): (orphaned, _ready_again),
    (S.ORPHANED, S.LOCAL_PREFILL): (lambda: orphaned("colocated"), _ready_again),
    (S.ORPHANED, S.ENDED): (orphaned, _abort),
    (S.RESERVING, S.WAITING_ROOM): (reserving, _reserve_waiting),
    (S.RESERVING, S.DISPATCHED): (reserving, _reserved(True)),
    (S.RESERVING, S.LOCAL_PREFILL): (reserving, _reserved(False)),
    # moved to another prefill worker, but the one it left got there first: its report, or its KV
    (S.RESERVING, S.PREFILLED): (redirected, _prefilled),
    (S.RESERVING, S.DECODING): (redirected, _first_token),
    (S.RESERVING, S.ENDED): (reserving, _abort),
    (S.WAITING_ROOM, S.STAGING): (_waiting_behind_another, lambda core, f: core.prefilled("b", 1.0)),
    (S.WAITING_ROOM, S.DISPATCHED): (waiting_room, _reserved(True)),
    (S.WAITING_ROOM, S.LOCAL_PREFILL): (waiting_room, _reserved(False)),
    (S.WAITING_ROOM, S.RESERVING): (waiting_room, _stalled_then_reserved),
    (S.WAITING_ROOM, S.ENDED): (waiting_room, _abort),
    (S.STAGING, S.STAGED): (staging, _staged(True)),
    (S.STAGING, S.WAITING_ROOM): (staging, _prefill_died),  # (a dropped pass: back to waiting, staged again)
    (S.STAGING, S.DISPATCHED): (staging, _reserved(True)),
    (S.STAGING, S.LOCAL_PREFILL): (staging, _reserved(False)),
    (S.STAGING, S.RESERVING): (staging, _stalled_then_reserved),
    (S.STAGING, S.ENDED): (staging, _abort),
    (S.STAGED, S.DISPATCHED): (staged, _reserved(True)),
    (S.STAGED, S.WAITING_ROOM): (staged, _prefill_died),  # what it staged died with it
    (S.STAGED, S.LOCAL_PREFILL): (staged, _reserved(False)),
    (S.STAGED, S.RESERVING): (staged, _stalled_then_reserved),
    (S.STAGED, S.ENDED): (staged, _abort),
    (S.DISPATCHED, S.PREFILLED): (dispatched, _prefilled),
    (S.DISPATCHED, S.LOCAL_PREFILL): (dispatched, lambda core, f: core.transfer_outcome(f.rid, "recompute", f.xfer)),
    (S.DISPATCHED, S.RESERVING): (dispatched, _prefill_died),
    (S.DISPATCHED, S.DECODING): (dispatched, _first_token),
    (S.DISPATCHED, S.ENDED): (dispatched, _abort),
    # its KV never came whole and its prefill worker is not heard: its decode worker recomputes
    (S.PREFILLED, S.LOCAL_PREFILL): (prefilled, lambda core, f: core.transfer_outcome(f.rid, "held", f.xfer, 2.0)),
    (S.PREFILLED, S.DECODING): (prefilled, _first_token),
    (S.PREFILLED, S.ENDED): (prefilled, _abort),
    (S.LOCAL_PREFILL, S.DECODING): (local_prefill, _first_token),
    (S.LOCAL_PREFILL, S.ENDED): (local_prefill, _abort),
    (S.DECODING, S.ENDED): (decoding, lambda core, f: core.token(f.rid, 1, True, 2.0, 8)),
}


def test_the_moves_exercised_are_the_table():
    assert set(MOVES) == {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert set(TRANSITIONS) == set(Stage) and TRANSITIONS[S.ENDED] == frozenset()


@pytest.mark.parametrize("move", list(MOVES), ids=lambda m: f"{m[0].name}->{m[1].name}")
def test_each_allowed_move_is_reached_by_the_core(move):
    start, end = move
    setup, event = MOVES[move]
    if event is None:  # NEW -> ORPHANED: the copy a dead worker's request moves as
        _, f = orphaned()
        assert f.stage is end
        return
    core, f = setup()
    assert f.stage is start
    event(core, f)
    f = core.flights.get(f.rid, f) if start is S.NEW or start is S.ORPHANED else f
    assert f.stage is end


def test_a_move_the_table_lacks_raises():
    f = FlightState("a", PROMPT, {}, "default", 0.0)
    with pytest.raises(IllegalTransition, match="NEW to DECODING"):
        f.advance(Stage.DECODING)
    f.advance(Stage.NEW)  # staying is no move
    core, f = staging()
    with pytest.raises(IllegalTransition, match="STAGING to DECODING"):  # a token before its blocks were reserved
        _first_token(core, f)
    core, f = _after(decoding, _abort)
    with pytest.raises(IllegalTransition, match="ENDED to RESERVING"):
        f.advance(Stage.RESERVING)
