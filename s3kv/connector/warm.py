"""Warm start: stage the hottest and pinned prefixes before the first request.

After a redeploy the first requests are the ones that hurt most. The manifest's usage records
(hits, writes, pins) say which prefix chains earlier instances used; the connector stages the
hottest of them, pinned ones first, up to ``warm_start_bytes``, and the scheduler's
``wait_for_initialization`` waits for that up to ``warm_start_timeout``. Progress goes to the
log and to the metrics (``warm_blocks_planned``, ``warm_blocks_staged``, ``warm_ready``).
"""

from __future__ import annotations

import logging
import threading
import time

from s3kv.connector.shared import ShardStores
from s3kv.errors import CodecError, StorageError
from s3kv.keys import BlockHash
from s3kv.store import KVStore

logger = logging.getLogger(__name__)


class WarmStart:
    """Plans and runs the warm staging in a background thread.

    Args:
        shards: The shard stores to stage into.
        leader: The store whose manifest usage picks the chains (rank 0's shard).
        budget_bytes: Raw bytes to stage at most (per shard).
        timeout: Longest :meth:`wait` blocks.
    """

    def __init__(self, shards: ShardStores, leader: KVStore, budget_bytes: int, timeout: float):
        self.shards = shards
        self.leader = leader
        self.budget_bytes = budget_bytes
        self.timeout = timeout
        self.planned = 0
        self.staged = 0
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3kv-warm", daemon=True)

    def start(self) -> None:
        """Begin staging in the background."""
        self._thread.start()

    def wait(self) -> bool:
        """Block until warm staging is done or the timeout passed; True if done."""
        return self.done.wait(self.timeout)

    def _run(self) -> None:
        started = time.monotonic()
        metrics = self.leader.metrics
        try:
            if self.budget_bytes <= 0:
                return
            budget_blocks = self.budget_bytes // (self.leader.block_nbytes or 1)
            # NOTE: only the hottest rows are kept while the usage streams in shard by shard
            # (bounded memory at any key count); twice the budget leaves room for the
            # ancestors a chain needs, which are at least as hot as their descendants.
            usage = self.leader.usage(top=2 * budget_blocks + 1024)
            # NOTE: the usage table records stored sizes, staging holds raw bytes: ask for
            # generously many chains by stored size, then cut by raw block count.
            chains = usage.hottest_chains(self.budget_bytes)
            selected: dict[bytes, None] = {}
            for chain in chains:
                for key in chain:
                    if len(selected) >= budget_blocks:
                        break
                    selected.setdefault(key, None)
            keys = [BlockHash(k) for k in selected]
            self.planned = len(keys)
            metrics.set("warm_blocks_planned", self.planned)
            logger.info(
                "s3kv: warm start: staging %d blocks of %d hottest chains",
                self.planned,
                len(chains),
            )
            self._stage(keys, started + self.timeout)
            self.staged = sum(1 for k in keys if self.shards.staged_everywhere(k))
            metrics.set("warm_blocks_staged", self.staged)
        except (StorageError, CodecError) as exc:
            logger.warning("s3kv: warm start skipped: %s", exc)
        finally:
            metrics.set("warm_ready", 1)
            self.done.set()
            logger.info(
                "s3kv: warm start done: %d/%d blocks staged in %.1f s",
                self.staged,
                self.planned,
                time.monotonic() - started,
            )

    def _stage(self, keys: list[BlockHash], deadline: float) -> None:
        """Stage ``keys`` in windows of at most half the prefetch queue, each awaited before
        the next: the store drops prefetches past ``max_prefetch_queue`` (a budget of 6 GiB
        in 1 MiB blocks is 6,144 keys against a default queue of 4,096), and the other half
        stays free for the first requests' own prefetches."""
        window = max(1, self.leader.config.max_prefetch_queue // 2)
        for start in range(0, len(keys), window):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            part = keys[start : start + window]
            self.shards.prefetch(part)
            self.shards.wait_staged(part, left)


__all__ = [
    "WarmStart",
]
