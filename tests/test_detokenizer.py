"""IncrementalDetokenizer with the default model's real byte-level BPE tokenizer: multi-byte UTF-8 across
tokens, stop strings (also split across tokens) and the streaming hold-back."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine

TEXTS = [
    "Hello, world! The answer is 42.",
    "héllo wörld, café naïve façade",
    "日本語のテキストです。中文也可以。",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 done",
    "Ελληνικά και русский текст",
    "mixed: a😀b世céd 🧑‍🚀!",
    "  leading spaces\n\nnew lines\ttabs  ",
]


@pytest.fixture(scope="module")
def tok():
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    return Tokenizer.from_dir(resolve_model_dir(None))


def stream(tok, ids, stop=(), include=False):
    """Feed ids one at a time; return (detokenizer, non-final pieces, final piece, index of the stopping token)."""
    d = IncrementalDetokenizer(tok, tuple(stop), include)
    pieces, stopped_at = [], None
    for i, token_id in enumerate(ids):
        if d.push([token_id]):
            stopped_at = i
            break
        pieces.append(d.take_new_text(final=False))
    return d, pieces, d.take_new_text(final=True), stopped_at


def multi_token(tok, text: str) -> bool:
    return any(tok.decode([i]) != text for i in tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_matches_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    expected = tok.decode(ids)
    assert expected == text
    d, pieces, last, stopped_at = stream(tok, ids)
    assert stopped_at is None and d.stopped_on is None
    assert "".join(pieces) + last == expected
    assert d.text == expected
    assert not any("\ufffd" in p for p in pieces + [last])
    # Without stop strings nothing is held back: each piece is handed out as soon as it is complete.
    assert last == ""


def test_multi_byte_characters_really_span_tokens(tok):
    # Guard: the texts above exercise split UTF-8 sequences, so the hold-back path is tested.
    split = [t for t in TEXTS if any("\ufffd" in tok.decode([i]) for i in tok.encode(t, add_special_tokens=False))]
    assert len(split) >= 3


@pytest.mark.parametrize("text", TEXTS)
def test_push_many_at_once(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    for k in range(0, len(ids), 3):
        assert d.push(ids[k:k + 3]) is False
    assert d.text == text


def test_incomplete_character_is_held_back(tok):
    ids = tok.encode("I like 😀 a lot", add_special_tokens=False)
    partial = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok)
    d.push(ids[:partial])
    # The token holding the emoji's first bytes (and the space before it) waits for the rest.
    assert d.text == tok.decode(ids[:partial - 1]) == "I like"
    assert d.take_new_text(final=True) == "I like"
    d.push(ids[partial:])
    assert d.text == "I like 😀 a lot"


def test_special_tokens_skipped(tok):
    eos = tok.eos_token_ids[0]
    ids = tok.encode("Hi there", add_special_tokens=False) + [eos] + tok.encode(" 😀 again", add_special_tokens=False)
    d, pieces, last, _ = stream(tok, ids)
    assert d.text == tok.decode(ids, skip_special_tokens=True) == "Hi there 😀 again"
    assert "".join(pieces) + last == d.text


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text,stop", [
    ("Hello, world! The answer is 42.", "answer is"),  # two whole tokens
    ("Hello, world! The answer is 42.", "wer i"),  # ends inside tokens at both sides
    ("I like 😀 a lot", "😀"),  # a stop string made of partial byte tokens
    ("こんにちは世界です", "世界"),
    ("héllo wörld, café naïve façade", "é n"),
])
def test_stop_string_split_across_tokens(tok, text, stop, include):
    ids = tok.encode(text, add_special_tokens=False)
    assert multi_token(tok, stop), "the stop string must span tokens for this test to mean anything"
    d, pieces, last, stopped_at = stream(tok, ids, (stop,), include)
    cut = text.index(stop)
    expected = text[:cut + len(stop)] if include else text[:cut]
    assert stopped_at is not None and d.stopped_on == stop
    assert d.text == expected
    assert "".join(pieces) + last == expected
    # It stopped at the token that completed the stop string, not later.
    assert stop in tok.decode(ids[:stopped_at + 1])
    assert stop not in tok.decode(ids[:stopped_at])
    # While streaming, no piece (or run of pieces) ever shows the stop string or anything past its start.
    streamed = "".join(pieces)
    assert stop not in streamed
    assert text[:cut].startswith(streamed)
    assert not any("\ufffd" in p for p in pieces + [last])


def test_stop_string_not_present(tok):
    text = "Hello, world! The answer is 42."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "answer was"
    d, pieces, last, stopped_at = stream(tok, ids, (stop,))
    assert stopped_at is None and d.stopped_on is None
    assert d.text == text
    # The last len(stop) - 1 characters wait for the final call (they could have started the stop string).
    assert len(last) == len(stop) - 1
    assert "".join(pieces) + last == text


def test_holdback_while_streaming(tok):
    text = "Hello, world! The answer is 42."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "xyz!"
    d = IncrementalDetokenizer(tok, (stop,))
    handed = ""
    for token_id in ids:
        d.push([token_id])
        handed += d.take_new_text(final=False)
        assert d.text.startswith(handed)
        assert len(handed) == max(len(d.text) - (len(stop) - 1), 0)
    assert handed + d.take_new_text(final=True) == text
    assert d.take_new_text(final=True) == ""


def test_stop_string_inside_one_token(tok):
    text = "Hello, world! The answer is 42."
    ids = tok.encode(text, add_special_tokens=False)
    d, pieces, last, stopped_at = stream(tok, ids, ("nsw",))
    assert d.text == "Hello, world! The a"
    assert "".join(pieces) + last == d.text
    assert tok.decode([ids[stopped_at]]) == " answer"


def test_first_completed_stop_string_wins(tok):
    text = "Hello, world! The answer is 42."
    ids = tok.encode(text, add_special_tokens=False)
    # "The answer is" starts first but "answer" completes first: generation stops when any stop appears.
    d, pieces, last, _ = stream(tok, ids, ("The answer is", "answer"))
    assert d.stopped_on == "answer"
    assert d.text == "Hello, world! The "
    assert "".join(pieces) + last == d.text
    # Two stops completed by the same token: the one starting first is used.
    d, pieces, last, _ = stream(tok, ids, ("wer", "answ"))
    assert d.stopped_on == "answ" and d.text == "Hello, world! The "


def test_stop_at_very_start(tok):
    ids = tok.encode("Hello, world", add_special_tokens=False)
    d, pieces, last, stopped_at = stream(tok, ids, ("Hel",))
    assert stopped_at == 0 and d.text == "" and pieces == [] and last == ""
    d, pieces, last, _ = stream(tok, ids, ("Hel",), include=True)
    assert d.text == "Hel" and last == "Hel"


# ---- through the engine ------------------------------------------------------------------------------
def _engine(tok, **kw):
    ex = FakeExecutor(block_size=4, vocab_size=tok.vocab_size)
    return LLMEngine(ex, SchedulerConfig(max_num_batched_tokens=16), num_kv_blocks=256, tokenizer=tok,
                     eos_token_ids=tok.eos_token_ids, **kw)


def _run(engine):
    final, streamed = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            streamed.setdefault(o.request_id, []).append(o.text)
            if o.finished:
                final[o.request_id] = o
    assert engine.block_manager.num_used_blocks == 0
    return final, streamed


def test_engine_stop_string_finishes_request(tok):
    prompt = "The three primary colors are"
    eng = _engine(tok)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id="free")
    ref = _run(eng)[0]["free"]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 40
    # Pick a stop string that first appears mid-generation, straddling a token boundary.
    stop = None
    for k in range(12, 36):
        prev = tok.decode(ref.token_ids[:k])
        head = tok.decode(ref.token_ids[:k + 1])
        cand = head[len(prev) - 2:len(prev) + 1]
        if "\ufffd" not in head and len(head) > len(prev) and len(cand) == 3 and cand not in prev:
            stop = cand
            break
    assert stop is not None
    d, _, _, stopped_at = stream(tok, ref.token_ids, (stop,))
    assert stopped_at is not None

    eng = _engine(tok)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop),
                    request_id="stopped")
    final, streamed = _run(eng)
    out = final["stopped"]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[:stopped_at + 1]
    assert out.text == d.text
    assert stop not in out.text
    assert ref.text.startswith(out.text)
    assert all(out.text.startswith(t) or t.startswith(out.text) for t in streamed["stopped"])


def test_engine_text_matches_decode(tok):
    eng = _engine(tok)
    eng.add_request("Bonjour, ça va? 😀", SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
                    request_id="a")
    out = _run(eng)[0]["a"]
    full = tok.decode(out.token_ids)
    # Random tokens may end in an incomplete UTF-8 sequence, which stays held back.
    assert out.text == full or (full.endswith("\ufffd") and full.startswith(out.text))


def test_engine_in_flight_text_never_shows_part_of_a_stop_string(tok):
    prompt = "The three primary colors are"
    params = dict(temperature=0, max_tokens=40, ignore_eos=True)
    eng = _engine(tok)
    eng.add_request(prompt, SamplingParams(**params), request_id="free")
    ids = _run(eng)[0]["free"].token_ids
    # A stop string whose first two characters end one token and whose last character starts the next.
    stop = None
    for k in range(4, 36):
        prev, head = tok.decode(ids[:k]), tok.decode(ids[:k + 1])
        cand = prev[-2:] + head[len(prev):len(prev) + 1]
        if "\ufffd" not in head and len(head) > len(prev) and len(cand) == 3 and cand not in prev:
            stop = cand
            break
    assert stop is not None
    eng = _engine(tok)
    eng.add_request(prompt, SamplingParams(stop=stop, **params), request_id="s")
    final, streamed = _run(eng)
    assert final["s"].finish_reason == "stop"
    # Every in-flight text must be a prefix of the final one (a client streams the differences).
    assert all(final["s"].text.startswith(t) for t in streamed["s"])
