"""The per-epoch record both runtimes keep under ``<dir>/epochs/<epoch>.msgpack``: with the durable state as of
``epoch``, enough to continue after a crash (sequencer counters, deferred transactions, input-log offsets, the
epoch's deterministic time and the earliest pending timer). One type, one encoding: a msgpack map by field
name, fields at their default left out, unknown fields ignored, so records of either runtime from before
this type (the node's ``NodeRecord``, Spark's ``EpochRecord``, same names and defaults) still decode."""

from __future__ import annotations

import math

import msgspec

__all__ = ["EpochRecord", "encode_record", "decode_record", "read_record"]


class EpochRecord(msgspec.Struct, omit_defaults=True):
    """The record of epoch ``epoch``. The input-log position is ``log_end`` on the durable node (one log: the
    offset after this epoch's marker, where replay starts) and ``starts``/``ends`` on Spark (per log
    partition: the offsets this epoch read); ``stats`` are Spark's per-epoch statistics."""

    epoch: int
    counters: list[int]  # the sequencers' counters after this epoch
    deferred: list[tuple[int, bytes]]  # (tid, encoded request) still deferred after this epoch
    starts: list[int] = []  # Spark: per input-log partition, the first offset this epoch read
    ends: list[int] = []  # Spark: ... and the offset after the last one
    stats: dict[str, float] = {}  # Spark: the epoch's statistics
    time: float = 0.0  # the epoch's deterministic time (the sequencer's, see charon.core.timers)
    next_due: float = -math.inf  # the earliest pending timer after this epoch (-inf: unknown)
    log_end: int = 0  # node: the input-log offset after this epoch's marker (replay starts here)
    # Spark: transactions per chunk (charon.core.epoch) of the next epoch, chosen when this one ended, so that a
    # replay of that epoch (its replies out, its record not written) cuts it where its first run did, whatever
    # the configuration after a restart (-1: not recorded, the runtime's own choice)
    next_chunk: int = -1
    # the admission state after this epoch (charon.core.admission: held TIDs, token buckets, run-time limits)
    admission: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EpochRecord)


def encode_record(rec: EpochRecord) -> bytes:
    """The record's bytes (a msgpack map)."""
    return _encoder.encode(rec)


def decode_record(data: bytes) -> EpochRecord:
    """A record from its bytes (``msgspec.ValidationError``/``DecodeError`` if they are not one)."""
    return _decoder.decode(data)


def read_record(path: str) -> EpochRecord | None:
    """The record in the file ``path``; None if there is none."""
    try:
        with open(path, "rb") as f:
            return decode_record(f.read())
    except FileNotFoundError:
        return None
