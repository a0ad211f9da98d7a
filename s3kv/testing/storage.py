"""The backend contract suite: subclass :class:`BackendTests` to test a backend of your own.

As ``zarr.testing.store.StoreTests`` for zarr's stores: one class of tests written only
against the :class:`~s3kv.storage.Backend` interface (a miss is ``None``, create-if-absent
where declared, listing in byte order, batched deletes, thread safety). s3kv runs it against
its memory, file, moto and SeaweedFS backends (``tests/test_storage_contract.py``)::

    import pytest
    from s3kv.testing.storage import BackendTests, Quirk

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):  # a fresh, empty backend per test
            return MyBackend(tmp_path)

        @pytest.fixture
        def backend_quirks(self):  # only for known, accepted departures from S3
            return frozenset({Quirk.EMPTIED_DIRECTORIES_REMAIN})

Parametrise the ``backend`` fixture to run the suite against several backends; the
``backend_quirks`` fixture may then depend on the parameter (``request.node.callspec``). A test
that probes a declared quirk becomes a strict xfail: it must fail, so a quirk that goes away
is noticed. Keys follow s3kv's real layout (``<prefix>/<fingerprint>/blocks/<hh>/<hex>``)
where listing order matters. Needs pytest (the ``test`` extra).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest

from s3kv.storage import DELETE_BATCH, Backend

__all__ = ["BackendTests", "Quirk"]


class Quirk(enum.Enum):
    """A known way a backend departs from S3's semantics, declared by ``backend_quirks``."""

    #: Lists in directory-walk order, not byte order ("p/c/d" before "p/c-x"), and skips the
    #: whole "p/c/" directory for ``start_after="p/c"`` (SeaweedFS 4.48). s3kv's key layout
    #: never puts a directory and a sibling with a lower byte after their common prefix side
    #: by side (hex shards, fixed-width names), and it resumes only after full keys.
    LIST_ORDER_BY_DIRECTORY = "list-order-by-directory"
    #: Keeps a directory whose objects were all deleted and goes on listing it as a common
    #: prefix (SeaweedFS 4.48): ``list_dirs`` may name a directory with nothing below it.
    EMPTIED_DIRECTORIES_REMAIN = "emptied-directories-remain"


def _block_key(shard: int, index: int, root: str = "kv/fp0") -> str:
    return f"{root}/blocks/{shard:02x}/{shard:02x}{index:06x}"


def _expect_failure(request: pytest.FixtureRequest, quirks: frozenset[Quirk], quirk: Quirk) -> None:
    if quirk in quirks:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"declared quirk {quirk.value}"))


class BackendTests:
    """The :class:`~s3kv.storage.Backend` contract; subclass it as ``Test...`` (see the module).

    Needs a ``backend`` fixture (a fresh, empty backend per test; not closed by the suite);
    ``backend_quirks`` defaults to none.
    """

    #: Slack between the backend's clock and ours (SeaweedFS stores whole seconds).
    clock_slack_s: ClassVar[float] = 5.0

    @pytest.fixture
    def backend_quirks(self) -> frozenset[Quirk]:
        """The backend's declared departures from S3 (override it; default: none)."""
        return frozenset()

    # --- get / put ---------------------------------------------------------------------

    def test_get_missing_is_none(self, backend: Backend) -> None:
        assert backend.get("kv/fp0/blocks/00/missing") is None

    def test_head_missing_is_none(self, backend: Backend) -> None:
        assert backend.head("kv/fp0/blocks/00/missing") is None

    @pytest.mark.parametrize(
        "payload",
        [
            pytest.param(b"", id="empty"),
            pytest.param(b"x", id="one-byte"),
            pytest.param(bytes(range(256)) * 16, id="4KiB-all-byte-values"),
            pytest.param(os.urandom(5 * 1024 * 1024), id="5MiB"),
        ],
    )
    def test_put_get_round_trip(self, backend: Backend, payload: bytes) -> None:
        assert backend.put("kv/fp0/obj", payload) is True
        assert backend.get("kv/fp0/obj") == payload

    def test_put_accepts_memoryview(self, backend: Backend) -> None:
        buffer = bytearray(os.urandom(64 * 1024))
        view = memoryview(buffer)[1024:-1024]  # a slice: not the whole buffer
        assert backend.put("kv/fp0/view", view) is True
        buffer[2000] ^= 0xFF  # mutating the source afterwards must not change the object
        got = backend.get("kv/fp0/view")
        assert got is not None
        assert len(got) == 62 * 1024
        assert got[2000 - 1024] != buffer[2000]

    def test_put_accepts_typed_memoryview(self, backend: Backend) -> None:
        view = memoryview(bytearray(range(16))).cast("I")  # 4 uint32 items, 16 bytes
        backend.put("kv/fp0/typed", view)
        assert backend.get("kv/fp0/typed") == bytes(range(16))

    def test_overwrite_replaces(self, backend: Backend) -> None:
        backend.put("kv/fp0/obj", b"first")
        assert backend.put("kv/fp0/obj", b"second, longer") is True
        assert backend.get("kv/fp0/obj") == b"second, longer"
        info = backend.head("kv/fp0/obj")
        assert info is not None
        assert info.size == len(b"second, longer")

    def test_put_if_absent_creates(self, backend: Backend) -> None:
        assert backend.put("kv/fp0/new", b"v1", if_absent=True) is True
        assert backend.get("kv/fp0/new") == b"v1"

    def test_put_if_absent_never_overwrites(self, backend: Backend) -> None:
        backend.put("kv/fp0/obj", b"original")
        written = backend.put("kv/fp0/obj", b"replacement", if_absent=True)
        if backend.capabilities.conditional_put:
            assert written is False
            assert backend.get("kv/fp0/obj") == b"original"
        else:  # documented fallback: a plain PUT
            assert written is True
            assert backend.get("kv/fp0/obj") == b"replacement"

    def test_if_absent_race_has_one_winner(self, backend: Backend) -> None:
        if not backend.capabilities.conditional_put:
            pytest.skip("backend declares no conditional PUT")
        barrier = threading.Barrier(4)

        def attempt(i: int) -> bool:
            barrier.wait()
            return backend.put("kv/fp0/raced", f"writer {i}".encode(), if_absent=True)

        # NOTE: 4 racers, not more: SeaweedFS 4.48 makes each loser of a conditional-PUT
        # race wait about one more second (1 s, 2 s, 3 s...) before its 412.
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(attempt, range(4)))
        assert results.count(True) == 1
        winner = results.index(True)
        assert backend.get("kv/fp0/raced") == f"writer {winner}".encode()

    # --- head --------------------------------------------------------------------------

    def test_head_reports_size_and_time(self, backend: Backend) -> None:
        before = time.time()
        backend.put("kv/fp0/obj", b"12345")
        after = time.time()
        info = backend.head("kv/fp0/obj")
        assert info is not None
        assert info.key == "kv/fp0/obj"
        assert info.size == 5
        assert before - self.clock_slack_s <= info.last_modified <= after + self.clock_slack_s

    # --- list --------------------------------------------------------------------------

    def test_list_by_prefix_in_key_order(self, backend: Backend) -> None:
        keys = [_block_key(s, i) for s in (0xFF, 0x0A, 0x1B) for i in (2, 0, 1)]
        others = ["kv/fp0/identity.json", "kv/fp1/blocks/0a/0a000000", "kv/fp0b"]
        for n, key in enumerate(keys + others):
            backend.put(key, b"x" * n)
        listed = list(backend.list("kv/fp0/blocks/"))
        assert [info.key for info in listed] == sorted(keys)
        sizes = {key: n for n, key in enumerate(keys)}
        assert all(info.size == sizes[info.key] for info in listed)

    def test_list_start_after(self, backend: Backend) -> None:
        keys = sorted(_block_key(s, i) for s in (0x0A, 0x1B, 0xFF) for i in range(3))
        for key in keys:
            backend.put(key, b"v")
        # Resume after an existing key, after a key that does not exist, and before all.
        for start in (keys[4], _block_key(0x1B, 1) + "0", "kv/fp0/blocks/", keys[-1]):
            got = [info.key for info in backend.list("kv/fp0/", start_after=start)]
            assert got == [k for k in keys if k > start], start

    def test_list_empty_prefix_lists_everything(self, backend: Backend) -> None:
        backend.put("a/1", b"")
        backend.put("b/2", b"")
        assert [info.key for info in backend.list("")] == ["a/1", "b/2"]

    def test_list_unusual_characters(self, backend: Backend) -> None:
        keys = ["kv/with space", "kv/plus+sign", "kv/ünïcode", "kv/percent%20"]
        for key in keys:
            backend.put(key, key.encode())
        assert [info.key for info in backend.list("kv/")] == sorted(keys)
        assert all(backend.get(key) == key.encode() for key in keys)

    def test_list_dirs_names_each_directory_once(self, backend: Backend) -> None:
        for key in (
            "kv/fp1/identity.json",
            "kv/fp0/blocks/0a/0a",
            "kv/fp0/manifest/s1",
            "kv/loose",
            "kv2/fp9/x",
            "top",
        ):
            backend.put(key, b"")
        assert list(backend.list_dirs("kv/")) == ["fp0", "fp1"]  # not the object "kv/loose"
        assert list(backend.list_dirs("kv/fp0/")) == ["blocks", "manifest"]
        # The root may also hold ".s3kv-probe"'s parent: opening an S3 backend probes there.
        assert {"kv", "kv2"} <= set(backend.list_dirs(""))
        assert list(backend.list_dirs("absent/")) == []

    def test_list_dirs_forgets_emptied_directories(
        self, backend: Backend, backend_quirks: frozenset[Quirk], request: pytest.FixtureRequest
    ) -> None:
        # S3 has no directories, only keys: a directory exists while a key lies below it.
        _expect_failure(request, backend_quirks, Quirk.EMPTIED_DIRECTORIES_REMAIN)
        backend.put("kv/gone/blocks/0a/0a", b"")
        backend.put("kv/kept/identity.json", b"")
        backend.delete_many(["kv/gone/blocks/0a/0a"])
        assert list(backend.list_dirs("kv/")) == ["kept"]

    def test_probe_conditional_put_agrees_with_the_capability(self, backend: Backend) -> None:
        probed = backend.probe_conditional_put("kv")
        if backend.capabilities.conditional_put:  # declared: the server must really honour it
            assert probed is True
        assert list(backend.list("kv/")) == []  # the S3 probe deletes its scratch object

    # --- many keys: pagination and delete batches --------------------------------------

    def test_many_keys_paginate_and_delete_in_batches(self, backend: Backend) -> None:
        count = DELETE_BATCH + 100  # more than one ListObjectsV2 page and one delete batch
        keys = [_block_key(i % 256, i) for i in range(count)]
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(lambda k: backend.put(k, b"."), keys))

        listed = [info.key for info in backend.list("kv/fp0/blocks/")]
        assert listed == sorted(keys)

        absent = ["kv/fp0/blocks/zz/never-written"]
        result = backend.delete_many(iter(keys + absent))  # any iterable, even a generator
        assert result.failed == {}
        assert sorted(result.deleted) == sorted(keys + absent)  # absent counts as deleted
        assert list(backend.list("kv/fp0/")) == []

    def test_delete_many_nothing(self, backend: Backend) -> None:
        result = backend.delete_many([])
        assert result.deleted == []
        assert result.failed == {}

    def test_delete_then_get_is_none(self, backend: Backend) -> None:
        backend.put("kv/fp0/a", b"1")
        backend.put("kv/fp0/b", b"2")
        assert backend.delete_many(["kv/fp0/a"]).deleted == ["kv/fp0/a"]
        assert backend.get("kv/fp0/a") is None
        assert backend.head("kv/fp0/a") is None
        assert backend.get("kv/fp0/b") == b"2"

    # --- threads -----------------------------------------------------------------------

    def test_concurrent_puts_and_gets(self, backend: Backend) -> None:
        def worker(t: int) -> list[str]:
            errors = []
            for i in range(15):
                key = f"kv/fp0/threads/{t:02d}/{i:03d}"
                payload = f"{t}:{i}:".encode() * (i + 1)
                backend.put(key, payload)
                if backend.get(key) != payload:
                    errors.append(key)
            return errors

        with ThreadPoolExecutor(8) as pool:
            failures = [key for errors in pool.map(worker, range(8)) for key in errors]
        assert failures == []
        assert len(list(backend.list("kv/fp0/threads/"))) == 8 * 15

    # --- interface niceties ------------------------------------------------------------

    def test_description_names_the_location(self, backend: Backend) -> None:
        assert backend.description
        assert "secret" not in backend.description.lower()

    def test_check_passes_on_a_healthy_backend(self, backend: Backend) -> None:
        backend.check()

    def test_list_order_with_dash_vs_slash(
        self, backend: Backend, backend_quirks: frozenset[Quirk], request: pytest.FixtureRequest
    ) -> None:
        # S3 orders keys by bytes: "p/c-x" < "p/c/d" ('-' is 0x2d, '/' is 0x2f).
        _expect_failure(request, backend_quirks, Quirk.LIST_ORDER_BY_DIRECTORY)
        for key in ("p/c/d", "p/c-x", "p/c0"):
            backend.put(key, b"")
        assert [info.key for info in backend.list("p/")] == ["p/c-x", "p/c/d", "p/c0"]
        assert [info.key for info in backend.list("p/", start_after="p/c")] == [
            "p/c-x",
            "p/c/d",
            "p/c0",
        ]
