"""The operator tools under tensor parallelism: shards' blocks, one manifest per layout.

A TP=2 layout as engines leave it: each shard's ``identity.json`` and blocks under its own
fingerprint; the layout's ``identity.json`` (naming the shards) and its one manifest under
the layout fingerprint, which holds no blocks. Writes are recorded the engine's way
(:class:`~s3kv.manifest.ShardedPresence`: a key once every shard reported it) and so are
hits (shard 0's view). The in-memory bucket's clock sets each object's ``LastModified``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cli_support import DAY, PREFIX, TOKENS_PER_BLOCK, Bucket, Clock, invoke, parse_json

from s3kv.cli.context import Runtime
from s3kv.connector.shared import _describe_layout
from s3kv.keys import ROOT_HASH, BlockHash, ModelIdentity, identity_object_key, layout_fingerprint
from s3kv.manifest import Manifest, ShardedPresence, compact, load_usage
from s3kv.ops import compaction, prune, verify
from s3kv.ops.compaction import compact_scope
from s3kv.ops.pins import PinTarget, list_pins, set_pins
from s3kv.ops.prune import execute_prune, plan_prune
from s3kv.ops.scope import Fingerprint, resolve_scope
from s3kv.ops.stats import collect_stats
from s3kv.ops.verify import verify_objects
from s3kv.storage import FileBackend, MemoryBackend

T0 = 1_700_000_000.0
HOUR = 3600.0


def shard_identity(rank: int, tp: int = 2, model_id: str = "test/model") -> ModelIdentity:
    return ModelIdentity(
        model_id=model_id, weights_revision="r1", dtype="bfloat16", kv_dtype="bfloat16",
        quantization="none", tokens_per_block=TOKENS_PER_BLOCK, kv_factor=2, block_elems=32,
        num_layers=2, layout="test", tp_size=tp, tp_rank=rank,
    )  # fmt: skip


class Layout:
    """A TP layout in ``bucket``, as the connector writes one (module docstring)."""

    def __init__(self, bucket: Bucket, tp: int = 2, *, describe: bool = True) -> None:
        self.bucket = bucket
        self.identities = [shard_identity(rank, tp) for rank in range(tp)]
        self.shards = [identity.fingerprint() for identity in self.identities]
        self.fingerprint = layout_fingerprint(self.identities)
        for identity in self.identities:
            bucket.write_identity(identity)
        if describe:
            _describe_layout(bucket.backend, bucket.prefix, self.fingerprint, self.identities)

    def manifest(self, clock: Clock) -> Manifest:
        return Manifest(self.bucket.backend, self.bucket.prefix, self.fingerprint,
                        capacity=1000, fpr=0.01, clock=clock)  # fmt: skip

    def write_chain(
        self,
        keys: Sequence[BlockHash],
        clock: Clock,
        *,
        ranks: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        """PUT the chain's blocks on the shards of ``ranks`` (all by default), at
        ``clock.now``, and report each write to the layout's manifest as engines do."""
        presence = ShardedPresence(self.manifest(clock), len(self.shards))
        views = [presence.view(rank) for rank in range(len(self.shards))]
        parent = ROOT_HASH
        for i, key in enumerate(keys):
            for rank in range(len(self.shards)) if ranks is None else ranks:
                size = self.bucket.put_block(key, seed=seed + i, fingerprint=self.shards[rank])
                views[rank].record_write(key, parent, size)
            parent = key
        presence.flush()

    def record(
        self, clock: Clock, *, hits: Sequence[BlockHash] = (), pins: Sequence[BlockHash] = ()
    ) -> None:
        """Record hits and pins at ``clock.now``, through shard 0's view (as engines do)."""
        view = ShardedPresence(self.manifest(clock), len(self.shards)).view(0)
        if hits:
            view.record_hits(list(hits))
        if pins:
            view.record_pin(list(pins))
        assert view.flush() > 0

    def object_key(self, key: BlockHash, rank: int) -> str:
        return self.bucket.object_key(key, self.shards[rank])

    def has(self, key: BlockHash, rank: int) -> bool:
        return self.bucket.backend.head(self.object_key(key, rank)) is not None

    def manifest_keys(self) -> set[bytes]:
        rows = load_usage(self.bucket.backend, self.bucket.prefix, self.fingerprint).rows
        return set(rows["key"].tolist())


@pytest.fixture
def clock() -> Clock:
    return Clock(T0 - 20 * DAY)


@pytest.fixture
def bucket(clock: Clock) -> Bucket:
    return Bucket(MemoryBackend(clock=clock), "memory://", "test")


def _by_fp(scope: Sequence[Fingerprint]) -> dict[str, Fingerprint]:
    return {fp.fingerprint: fp for fp in scope}


# --- scope ----------------------------------------------------------------------------------


def test_scope_knows_each_fingerprints_manifest(bucket: Bucket) -> None:
    layout = Layout(bucket)
    plain = bucket.write_identity()  # a TP=1 engine: its manifest is its own
    found = _by_fp(resolve_scope(bucket.backend, PREFIX))
    assert set(found) == {*layout.shards, layout.fingerprint, plain}

    lay = found[layout.fingerprint]
    assert (lay.is_layout, lay.is_shard) == (True, False)
    assert lay.shards == lay.manifest_shards == tuple(layout.shards)
    assert lay.manifest_fingerprint == layout.fingerprint
    for shard in layout.shards:
        fp = found[shard]
        assert (fp.is_layout, fp.is_shard, fp.shards) == (False, True, ())
        assert fp.manifest_fingerprint == layout.fingerprint
        assert fp.manifest_shards == tuple(layout.shards)
    own = found[plain]
    assert (own.is_layout, own.is_shard) == (False, False)
    assert (own.manifest_fingerprint, own.manifest_shards) == (plain, (plain,))
    assert Fingerprint(plain).manifest_fingerprint == plain  # the default: its own

    # Narrowed to one shard, the layout (outside the scope) is still found.
    (narrow,) = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[1]])
    assert narrow.manifest_fingerprint == layout.fingerprint
    assert narrow.manifest_shards == tuple(layout.shards)


def test_scope_recomputes_a_layout_whose_identity_is_missing(bucket: Bucket, clock: Clock) -> None:
    layout = Layout(bucket, describe=False)  # the layout's identity.json is best effort
    (key,) = bucket.chain(range(4))
    layout.write_chain([key], clock)  # the layout's directory exists: its manifest
    assert bucket.backend.head(identity_object_key(PREFIX, layout.fingerprint)) is None
    found = _by_fp(resolve_scope(bucket.backend, PREFIX))
    assert found[layout.fingerprint].shards == tuple(layout.shards)
    assert {found[s].manifest_fingerprint for s in layout.shards} == {layout.fingerprint}
    (narrow,) = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[0]])
    assert narrow.manifest_fingerprint == layout.fingerprint


def test_scope_without_a_layout_directory_keeps_each_shards_own_manifest(bucket: Bucket) -> None:
    # Shards written before layouts shared a manifest: each kept its own.
    layout = Layout(bucket, describe=False)
    for rank, shard in enumerate(layout.shards):
        bucket.put_block(bucket.chain(range(4))[0], fingerprint=shard, seed=rank)
    found = _by_fp(resolve_scope(bucket.backend, PREFIX))
    assert set(found) == set(layout.shards)
    assert all(not fp.is_shard and not fp.is_layout for fp in found.values())


def test_a_tp1_layout_identity_is_a_plain_fingerprint(bucket: Bucket) -> None:
    single = shard_identity(0, 1)
    _describe_layout(bucket.backend, PREFIX, single.fingerprint(), [single])  # names itself
    (fp,) = resolve_scope(bucket.backend, PREFIX)
    assert (fp.is_layout, fp.is_shard, fp.manifest_shards) == (False, False, (fp.fingerprint,))


# --- prune ----------------------------------------------------------------------------------


class Scenario:
    """A TP=2 layout, every block written 20 days before ``T0`` (old ``LastModified``).

    * ``hot``: hit an hour before ``T0`` (in the layout's manifest only);
    * ``pinned``: its last block pinned;
    * ``stale``: never used again;
    * ``lone``: shard 0's object only (shard 1's save failed): never in the manifest;
    * ``fresh``: shard 0's object old, shard 1's re-written an hour before ``T0``, never
      in the manifest;
    * ``torn``: in the manifest, but shard 1's object is gone (a lifecycle rule).
    """

    def __init__(self, bucket: Bucket, clock: Clock) -> None:
        self.layout = layout = Layout(bucket)
        self.hot = bucket.chain(range(12))
        self.pinned = bucket.chain(range(100, 108))
        self.stale = bucket.chain(range(200, 212))
        (self.lone,) = bucket.chain(range(300, 304))
        (self.fresh,) = bucket.chain(range(400, 404))
        (self.torn,) = bucket.chain(range(500, 504))
        layout.write_chain(self.hot, clock)
        layout.write_chain(self.pinned, clock, seed=10)
        layout.write_chain(self.stale, clock, seed=20)
        layout.write_chain([self.lone, self.fresh], clock, ranks=[0], seed=30)
        layout.write_chain([self.torn], clock, seed=40)
        bucket.backend.delete_many([layout.object_key(self.torn, 1)])
        clock.now = T0 - 10 * DAY
        layout.record(clock, pins=[self.pinned[-1]])
        clock.now = T0 - HOUR
        layout.record(clock, hits=[self.hot[-1]])
        bucket.put_block(self.fresh, fingerprint=layout.shards[1], seed=31)
        clock.now = T0

    @property
    def kept(self) -> list[BlockHash]:
        return [*self.hot, *self.pinned, self.fresh]


def test_prune_keeps_hot_tp_blocks_and_drops_stale_keys_from_the_layout_manifest(
    bucket: Bucket, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hazard: a shard's usage is its layout's manifest, not its own (empty) one."""
    s = Scenario(bucket, clock)
    layout = s.layout
    assert layout.manifest_keys() == {*s.hot, *s.pinned, *s.stale, s.torn}
    compacted: list[str] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        compacted.append(args[2])
        return compact(*args, **kwargs)

    monkeypatch.setattr(prune, "compact", counting)
    scope = resolve_scope(bucket.backend, PREFIX)
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=DAY, clock=clock)
    assert bucket.backend.head(layout.object_key(s.hot[0], 0)) is not None  # a dry plan
    report = execute_prune(bucket.backend, plan, prefix=PREFIX, fpr=0.01, clock=clock)

    # Hot, pinned and fresh blocks stay on every shard; stale ones go from every shard.
    for key in s.kept:
        assert [layout.has(key, 0), layout.has(key, 1)] == [True, True], key.hex()
    for key in s.stale:
        assert [layout.has(key, 0), layout.has(key, 1)] == [False, False], key.hex()
    assert not layout.has(s.lone, 0)
    assert not layout.has(s.torn, 0)
    assert report.complete
    assert report.deleted.objects == 3 + 2 + 3  # stale, lone and torn on 0; stale on 1

    # The layout holds no blocks: only its shards were planned, against its manifest.
    assert [fp.fingerprint for fp in plan.fingerprints] == layout.shards
    assert {fp.manifest_fingerprint for fp in plan.fingerprints} == {layout.fingerprint}
    zero, one = plan.fingerprints
    assert {o.block for o in zero.delete} == {*s.stale, s.lone, s.torn}
    assert {o.block for o in one.delete} == set(s.stale)
    assert (zero.kept_recent.objects, zero.kept_pinned.objects) == (2, 1)  # hot[-1], fresh
    assert zero.kept_ancestor.objects == 2 + 1  # hot[-1]'s and the pinned block's
    assert (one.kept_recent.objects, one.kept_ancestor.objects) == (2, 3)
    assert list(zero.forget) == list(one.forget) == [s.torn]  # not on every shard

    # One compaction of the layout's manifest, which no longer advertises deleted keys.
    assert compacted == [layout.fingerprint]
    assert layout.manifest_keys() == {*s.hot, *s.pinned}
    assert {o.manifest_fingerprint for o in report.outcomes} == {layout.fingerprint}
    assert {(o.manifest_generation, o.manifest_keys_dropped) for o in report.outcomes} == {
        (report.outcomes[0].manifest_generation, 3 + 1)
    }
    # No shard grew a manifest of its own.
    for shard in layout.shards:
        assert not list(bucket.backend.list(f"{PREFIX}/{shard}/manifest/"))

    # Nothing is stale any more: a re-run plans and drops nothing.
    again = plan_prune(bucket.backend, PREFIX, resolve_scope(bucket.backend, PREFIX),
                       older_than=DAY, clock=clock)  # fmt: skip
    assert again.to_delete.objects == 0
    assert all(len(fp.forget) == 0 for fp in again.fingerprints)


def test_prune_on_the_layout_fingerprint_prunes_its_shards(bucket: Bucket, clock: Clock) -> None:
    s = Scenario(bucket, clock)
    layout = s.layout
    scope = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.fingerprint])
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=DAY, clock=clock)
    assert [fp.fingerprint for fp in plan.fingerprints] == layout.shards
    assert plan.fingerprints[0].model == "test/model"  # the shard's identity, read
    # The layout's directory has no blocks: that never makes its keys "gone".
    assert list(plan.fingerprints[0].forget) == [s.torn]
    report = execute_prune(bucket.backend, plan, prefix=PREFIX, fpr=0.01, clock=clock)
    assert report.complete
    assert layout.manifest_keys() == {*s.hot, *s.pinned}
    assert all(layout.has(k, 0) and layout.has(k, 1) for k in s.kept)


def test_prune_of_one_shard_drops_its_deleted_keys_from_the_layout_manifest(
    bucket: Bucket, clock: Clock
) -> None:
    s = Scenario(bucket, clock)
    layout = s.layout
    scope = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[1]])
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=DAY, clock=clock)
    (one,) = plan.fingerprints
    assert {o.block for o in one.delete} == set(s.stale)
    assert list(one.forget) == [s.torn]  # shard 1 lacks it: the layout cannot advertise it
    report = execute_prune(bucket.backend, plan, prefix=PREFIX, fpr=0.01, clock=clock)
    assert report.complete
    assert layout.manifest_keys() == {*s.hot, *s.pinned}  # presence needs every shard
    assert all(layout.has(k, 0) for k in s.stale)  # shard 0 was not in scope
    assert all(layout.has(k, 1) for k in s.kept)

    # Shard 0 next: its stale objects are no longer in any manifest, and old: deleted.
    scope = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[0]])
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=DAY, clock=clock)
    execute_prune(bucket.backend, plan, prefix=PREFIX, fpr=0.01, clock=clock)
    assert not any(layout.has(k, 0) for k in [*s.stale, s.lone, s.torn])
    assert all(layout.has(k, 0) for k in [*s.hot, *s.pinned])
    # NOTE: not ``fresh``: in no manifest, old on shard 0, and shard 1 (whose object of it
    # is recent) was not in scope to say so.


def test_one_shards_recent_object_keeps_the_key_on_every_shard(
    bucket: Bucket, clock: Clock
) -> None:
    s = Scenario(bucket, clock)
    layout = s.layout
    clock.now = T0 - HOUR
    bucket.put_block(s.stale[-1], fingerprint=layout.shards[1], seed=99)  # re-written
    clock.now = T0
    scope = resolve_scope(bucket.backend, PREFIX)
    plan = plan_prune(bucket.backend, PREFIX, scope, older_than=DAY, clock=clock)
    for fp in plan.fingerprints:  # the key and its ancestors, on both shards
        assert not {o.block for o in fp.delete} & set(s.stale), fp.fingerprint
    assert {o.block for o in plan.fingerprints[0].delete} == {s.lone, s.torn}


# --- compact --------------------------------------------------------------------------------


def test_compact_addresses_the_layout_manifest_once(bucket: Bucket, clock: Clock) -> None:
    layout = Layout(bucket)
    layout.write_chain(bucket.chain(range(12)), clock)
    scope = resolve_scope(bucket.backend, PREFIX)
    assert len(scope) == 3
    report = compact_scope(bucket.backend, scope, prefix=PREFIX, fpr=0.01, clock=clock)
    ((fp, first),) = report.reports
    assert (fp, first.keys, first.segments_folded) == (layout.fingerprint, 3, 1)
    shard_only = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[0]])
    ((fp, _),) = compact_scope(bucket.backend, shard_only, prefix=PREFIX, fpr=0.01).reports
    assert fp == layout.fingerprint
    for shard in layout.shards:
        assert not list(bucket.backend.list(f"{PREFIX}/{shard}/manifest/"))


def test_full_compaction_of_a_layout_keeps_the_keys_of_every_shard(
    bucket: Bucket, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(bucket)
    both = bucket.chain(range(12))
    (only0,) = bucket.chain(range(100, 104))
    (only1,) = bucket.chain(range(200, 204))
    for rank, shard in enumerate(layout.shards):  # objects whose segments were lost
        clock.now = T0 - (10 - rank) * DAY  # shard 1's objects are the later ones
        for i, key in enumerate(both):
            bucket.put_block(key, fingerprint=shard, seed=i + 7 * rank)
    bucket.put_block(only0, fingerprint=layout.shards[0])
    bucket.put_block(only1, fingerprint=layout.shards[1])
    loud = both[1].hex().upper()
    odd = f"{PREFIX}/{layout.shards[1]}/blocks/{loud[:2]}/{loud}"
    assert odd != layout.object_key(both[1], 1)
    bucket.backend.put(odd, bytes(10_000))  # a second, larger object of one block
    sizes = {
        key: [bucket.backend.head(layout.object_key(key, r)) for r in range(2)] for key in both
    }
    clock.now = T0
    listed: list[list[tuple[bytes, int, float]]] = []

    def spy(*args: Any, full_listing_keys: Any = None, **kwargs: Any) -> Any:
        if full_listing_keys is not None:
            full_listing_keys = list(full_listing_keys)
            listed.append(full_listing_keys)
        return compact(*args, full_listing_keys=full_listing_keys, **kwargs)

    monkeypatch.setattr(compaction, "compact", spy)
    scope = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.fingerprint])
    report = compact_scope(bucket.backend, scope, prefix=PREFIX, fpr=0.01, full=True, clock=clock)
    ((fp, done),) = report.reports
    assert (fp, done.listing_keys, done.keys) == (layout.fingerprint, 3, 3)
    assert layout.manifest_keys() == set(both)  # not only0's, nor only1's
    (listing,) = listed
    by_key = {key: (size, modified) for key, size, modified in listing}
    for key in both:
        infos = sizes[key]
        assert all(info is not None for info in infos)
        want_size = max(info.size for info in infos if info is not None)
        if key == both[1]:
            want_size = 10_000
        assert by_key[key] == (want_size, T0 - 9 * DAY)  # latest LastModified of the shards
    usage = load_usage(bucket.backend, PREFIX, layout.fingerprint)
    row = usage.row(both[2])
    assert row is not None
    assert row.last_used == T0 - 9 * DAY


# --- pins, verify, stats -------------------------------------------------------------------


def test_pins_live_in_the_layout_manifest(bucket: Bucket, clock: Clock) -> None:
    layout = Layout(bucket)
    chain = bucket.chain(range(8))
    layout.write_chain(chain, clock)
    (adoptable,) = bucket.chain(range(100, 104))
    (half,) = bucket.chain(range(200, 204))
    for rank, shard in enumerate(layout.shards):
        bucket.put_block(adoptable, fingerprint=shard, seed=rank)  # a lost segment
    bucket.put_block(half, fingerprint=layout.shards[0])  # shard 1 never written
    scope = resolve_scope(bucket.backend, PREFIX)
    targets = [PinTarget(chain[-1]), PinTarget(adoptable), PinTarget(half)]
    report = set_pins(bucket.backend, scope, lambda fp: targets, prefix=PREFIX, clock=clock)
    (outcome,) = report.outcomes  # one manifest, however many fingerprints in scope
    assert outcome.fingerprint == layout.fingerprint
    assert (outcome.changed, outcome.adopted, outcome.missing) == (2, 1, 1)
    pins = list_pins(bucket.backend, scope, prefix=PREFIX)
    assert sorted(p.key for p in pins) == sorted([chain[-1].hex(), adoptable.hex()])
    assert {p.fingerprint for p in pins} == {layout.fingerprint}
    for shard in layout.shards:
        assert not list(bucket.backend.list(f"{PREFIX}/{shard}/manifest/"))
    shard_only = resolve_scope(bucket.backend, PREFIX, fingerprints=[layout.shards[1]])
    assert len(list_pins(bucket.backend, shard_only, prefix=PREFIX)) == 2


def test_verify_drops_a_corrupt_shards_key_from_the_layout_manifest(
    bucket: Bucket, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(bucket)
    chain = bucket.chain(range(12))
    layout.write_chain(chain, clock)
    for key, rank in ((chain[1], 1), (chain[2], 0), (chain[2], 1)):
        blob = bytearray(bucket.backend.get(layout.object_key(key, rank)) or b"")
        blob[-1] ^= 0xFF
        bucket.backend.put(layout.object_key(key, rank), bytes(blob))
    compacted: list[tuple[str, list[bytes]]] = []

    def counting(*args: Any, drop_keys: Any, **kwargs: Any) -> Any:
        compacted.append((args[2], sorted(drop_keys)))
        return compact(*args, drop_keys=drop_keys, **kwargs)

    monkeypatch.setattr(verify, "compact", counting)
    scope = resolve_scope(bucket.backend, PREFIX)
    report = verify_objects(bucket.backend, scope, prefix=PREFIX, sample=None, delete=True,
                            fpr=0.01, clock=clock)  # fmt: skip
    assert (report.remaining, report.manifest_errors) == (0, ())
    assert report.count("corrupt") == 3
    assert compacted == [(layout.fingerprint, sorted([chain[1], chain[2]]))]
    assert layout.manifest_keys() == {chain[0]}
    for shard in layout.shards:
        assert not list(bucket.backend.list(f"{PREFIX}/{shard}/manifest/"))


def test_stats_reads_usage_from_the_layout_manifest(bucket: Bucket, clock: Clock) -> None:
    layout = Layout(bucket)
    chain = bucket.chain(range(12))
    layout.write_chain(chain, clock)
    clock.now = T0 - HOUR
    layout.record(clock, hits=[chain[0], chain[0]], pins=[chain[1]])
    clock.now = T0
    report = collect_stats(bucket.backend, resolve_scope(bucket.backend, PREFIX), prefix=PREFIX,
                           clock=clock)  # fmt: skip
    found = {fp.fingerprint: fp for fp in report.fingerprints}
    for shard in layout.shards:
        fp = found[shard]
        assert fp.manifest_fingerprint == layout.fingerprint
        assert (fp.objects, fp.hits, fp.pins, fp.manifest_keys, fp.unmanifested) == (3, 2, 1, 3, 0)
        assert fp.last_use["<1d"] == 1
        assert fp.manifest_error is None
    lay = found[layout.fingerprint]
    assert (lay.objects, lay.hits, lay.pins, lay.manifest_keys) == (0, 2, 1, 3)
    assert lay.requests_usd_month == 0.0  # its shards carry the requests
    assert lay.kinds["segments"].objects > 0


# --- the CLI, on a directory ----------------------------------------------------------------


def test_cli_prune_and_compact_on_a_tp_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")
    for name in ("TLLM_S3KV_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "bucket"
    root.mkdir()
    bucket = Bucket(FileBackend(root), f"file://{root}", bucket="")
    args = ["--prefix", bucket.prefix, "--endpoint-url", bucket.endpoint]
    t0 = time.time()  # file mtimes: the objects' LastModified
    layout = Layout(bucket)
    hot, stale = bucket.chain(range(8)), bucket.chain(range(100, 112))
    layout.write_chain(hot, Clock(t0 - 20 * DAY))
    layout.write_chain(stale, Clock(t0 - 20 * DAY), seed=10)
    layout.record(Clock(t0 + 8 * DAY - HOUR), hits=[hot[-1]])
    now = Runtime(clock=Clock(t0 + 8 * DAY))  # every object is eight days old by then

    pruned = invoke(["prune", "--older-than", "1d", "--yes", "--json", *args], runtime=now)
    assert pruned.exit_code == 0, pruned.output
    doc = parse_json(pruned)
    assert doc["deleted"]["objects"] == 2 * len(stale)
    assert [fp["fingerprint"] for fp in doc["fingerprints"]] == layout.shards
    assert {fp["manifest"]["fingerprint"] for fp in doc["fingerprints"]} == {layout.fingerprint}
    assert all(layout.has(k, r) for k in hot for r in (0, 1))
    assert not any(layout.has(k, r) for k in stale for r in (0, 1))
    assert layout.manifest_keys() == set(hot)

    # A full compaction (one entry: the layout's manifest) rebuilds the same keys.
    full = invoke(["compact", "--full", "--json", *args], runtime=now)
    assert full.exit_code == 0, full.output
    (entry,) = parse_json(full)["fingerprints"]
    assert (entry["fingerprint"], entry["keys"], entry["listing_keys"]) == (
        layout.fingerprint,
        len(hot),
        len(hot),
    )
    assert layout.manifest_keys() == set(hot)
