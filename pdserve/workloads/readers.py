"""Readers for the public trace formats described in /work/shared/traces/README.md.

Each reader returns `TraceRecord`s in file order, with times in seconds (None for length-only files).
Any problem (missing file, bad header, malformed row, empty file) becomes an `InvalidRequestError` whose
one-line message names the file and line, because the CLI prints it as `error: ...`.

* Mooncake JSONL: `{"timestamp": ms relative to the start, "input_length", "output_length", "hash_ids": [...]}`.
  `hash_ids` may be absent (then None); when present it must be a list of non-negative ints.
* Azure CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is wall-clock with 7 fractional digits, so it
  is truncated to 26 characters and parsed with `%Y-%m-%d %H:%M:%S.%f`. Times are returned relative to the
  earliest row.
* Length-only CSV: `num_prefill_tokens,num_decode_tokens,...` (extra columns ignored), no times.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from typing import Iterator, NamedTuple

from pdserve.errors import InvalidRequestError

AZURE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


class TraceRecord(NamedTuple):
    time_s: float | None
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None


def _open_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) pairs; unreadable files become InvalidRequestError."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from enumerate(f, start=1)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise InvalidRequestError(f"cannot read trace file {path}: {reason}") from None


def _as_length(value: object, what: str, where: str) -> int:
    """A token count >= 1 from an int, an integral float or a numeric string."""
    try:
        num = float(value) if isinstance(value, str) else value
        if isinstance(num, bool) or not isinstance(num, (int, float)) or num != int(num):
            raise ValueError
        n = int(num)
    except (ValueError, TypeError, OverflowError):
        raise InvalidRequestError(f"{where}: {what} must be a whole number, got {value!r}") from None
    if n < 1:
        raise InvalidRequestError(f"{where}: {what} must be >= 1, got {n}")
    return n


def _as_hash_ids(value: object, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                                              for h in value):
        raise InvalidRequestError(f"{where}: hash_ids must be a list of non-negative integers")
    return tuple(value)


def _nonempty(records: list[TraceRecord], path: str) -> list[TraceRecord]:
    if not records:
        raise InvalidRequestError(f"trace file {path} has no records")
    return records


def read_mooncake(path: str) -> list[TraceRecord]:
    records = []
    for lineno, line in _open_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise InvalidRequestError(f"{where}: expected a JSON object")
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in row]
        if missing:
            raise InvalidRequestError(f"{where}: missing field(s) {', '.join(missing)}")
        ts = row["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < float("inf"):
            raise InvalidRequestError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
        records.append(TraceRecord(ts / 1000.0, _as_length(row["input_length"], "input_length", where),
                                   _as_length(row["output_length"], "output_length", where),
                                   _as_hash_ids(row.get("hash_ids"), where)))
    return _nonempty(records, path)


def _csv_rows(path: str, required: tuple[str, ...]) -> Iterator[tuple[str, dict[str, str]]]:
    """(location, row) pairs of a CSV with a header that must contain `required`."""
    reader = csv.DictReader(line for _, line in _open_lines(path))
    try:
        yield from _checked_rows(reader, path, required)
    except csv.Error as e:
        raise InvalidRequestError(f"{path}:{reader.line_num}: not readable as CSV ({e})") from None


def _checked_rows(reader: csv.DictReader, path: str, required: tuple[str, ...]):
    header = reader.fieldnames
    if not header:
        raise InvalidRequestError(f"trace file {path} is empty (expected a header {','.join(required)})")
    missing = [c for c in required if c not in header]
    if missing:
        raise InvalidRequestError(f"{path}: header lacks column(s) {', '.join(missing)} "
                                  f"(expected {','.join(required)})")
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if None in row or any(row[c] is None for c in required):
            raise InvalidRequestError(f"{where}: wrong number of columns")
        yield where, row


def _parse_azure_time(text: str, where: str) -> datetime:
    try:
        return datetime.strptime(text.strip()[:26], AZURE_TIME_FORMAT)
    except ValueError:
        raise InvalidRequestError(f"{where}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS.ffffff'") from None


def read_azure(path: str) -> list[TraceRecord]:
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    rows = [(_parse_azure_time(row["TIMESTAMP"], where), _as_length(row["ContextTokens"], "ContextTokens", where),
             _as_length(row["GeneratedTokens"], "GeneratedTokens", where)) for where, row in _csv_rows(path, cols)]
    _nonempty(rows, path)
    t0 = min(r[0] for r in rows)
    return [TraceRecord((t - t0).total_seconds(), n_in, n_out, None) for t, n_in, n_out in rows]


def read_lengths(path: str) -> list[TraceRecord]:
    cols = ("num_prefill_tokens", "num_decode_tokens")
    return _nonempty([TraceRecord(None, _as_length(row[cols[0]], cols[0], where),
                                  _as_length(row[cols[1]], cols[1], where), None)
                      for where, row in _csv_rows(path, cols)], path)
