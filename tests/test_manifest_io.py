"""The one segment writer and the one log-once helper."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from s3kv._logonce import LogOnce
from s3kv.errors import PreconditionFailedError
from s3kv.keys import manifest_prefix
from s3kv.manifest import KIND_WRITE, RECORD_DTYPE, ManifestIO, SegmentWriter
from s3kv.storage import MemoryBackend

PREFIX, FP = "kv", "fp0123"
T0 = 1_700_000_000.0


def _records(n: int) -> np.ndarray:
    records = np.zeros(n, RECORD_DTYPE)
    records["key"] = [bytes([i]) * 16 for i in range(n)]
    records["kind"], records["count"], records["time"] = KIND_WRITE, 1, T0
    return records


def test_segment_writer_names_by_clock_and_sequence_and_round_trips() -> None:
    io = ManifestIO(MemoryBackend(), PREFIX, FP)
    writer = SegmentWriter(io, "inst-a", clock=lambda: T0)
    # Two writes in the same millisecond get consecutive sequence numbers.
    first, second = writer.write(_records(3)), writer.write(_records(1))
    assert (first, second) == ("1700000000000-inst-a-000000.seg", "1700000000000-inst-a-000001.seg")
    read = io.read_segment(first)
    assert read is not None
    assert read.tolist() == _records(3).tolist()
    assert io.requests == 3  # two PUTs, one GET


def test_segment_writer_skips_names_another_writer_took() -> None:
    backend = MemoryBackend()
    # A second writer with the same instance id already wrote sequence 0.
    SegmentWriter(ManifestIO(backend, PREFIX, FP), "shared", clock=lambda: T0).write(_records(1))
    name = SegmentWriter(ManifestIO(backend, PREFIX, FP), "shared", clock=lambda: T0).write(
        _records(2)
    )
    assert name == "1700000000000-shared-000001.seg"
    listed = sorted(info.key for info in backend.list(manifest_prefix(PREFIX, FP)))
    assert len(listed) == 2


def test_segment_writer_gives_up_when_every_name_is_taken() -> None:
    backend = MemoryBackend()
    for _ in range(5):
        SegmentWriter(ManifestIO(backend, PREFIX, FP), "x", clock=lambda: T0).write(_records(1))
    # The sixth writer from sequence 0 finds all five names it tries taken.
    with pytest.raises(PreconditionFailedError, match="instance_id shared"):
        SegmentWriter(ManifestIO(backend, PREFIX, FP), "x", clock=lambda: T0).write(_records(1))


def test_log_once_warns_once_per_kind_until_rearmed(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("s3kv.test_logonce")
    once = LogOnce(logger)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        once("flush:timeout", "failed %s", 1)
        once("flush:timeout", "failed %s", 2)  # a repeat: DEBUG
        once("refresh:timeout", "failed %s", 3)  # another kind: WARNING
        once.rearm("flush:")
        once("flush:timeout", "failed %s", 4)  # recovered, then failed again: WARNING
        once("refresh:timeout", "failed %s", 5)  # not re-armed: DEBUG
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "failed 1"),
        (logging.DEBUG, "failed 2"),
        (logging.WARNING, "failed 3"),
        (logging.WARNING, "failed 4"),
        (logging.DEBUG, "failed 5"),
    ]
