"""Opening a store against a bucket that may not answer: bounded, then in the background.

:meth:`KVStore.open <s3kv.store.KVStore.open>` with ``degraded_start=True`` (the connector's
way) runs the startup steps — the bucket check, the conditional-PUT probe, the identity object,
the manifest — in an opener thread and waits for them at most ``startup_timeout`` seconds. If
they finish in time the store opens as it always did. Otherwise — the endpoint hangs, refuses,
resets, throttles or answers 5xx, or says the bucket is missing or the credentials are denied —
the store opens *pending*: unhealthy, so it claims nothing, drops saves and skips prefetches
(what an open circuit breaker does), while the opener retries the steps until they succeed
(from then on the store claims and saves) or the store is closed.

Retry policy:

* Every attempt starts with a short check (HeadBucket, one attempt, connect and read timeouts
  of at most :data:`CHECK_TIMEOUT`), so an attempt against a dead endpoint costs seconds, not
  the configured ``read_timeout`` x ``max_attempts``.
* Backoff: 1 s, doubling, up to ``breaker_cooldown`` after transient failures (unreachable,
  timeouts, throttling, 5xx); up to :data:`OPERATOR_FACTOR` x ``breaker_cooldown`` after a
  missing bucket or denied credentials. Those need an operator (create the bucket, fix the IAM
  policy) but get fixed without a restart, so they are retried too, only less often.
* A :class:`~s3kv.errors.ConfigError` (no bucket configured) never heals: ``open`` raises it.

Logging: one line whenever the state of a bucket changes — WARNING when it does not answer,
ERROR when it is missing or access is denied (the line names the fix), WARNING when it answers
again — shared by every store of that bucket in the process (a TP layout opens one per
shard); repeats go to DEBUG. When a store of a bucket is already pending, the next store of it
does not wait: a layout of N shards costs one ``startup_timeout``, not N.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError, BucketNotFoundError, StorageError
from s3kv.keys import BlockHash
from s3kv.storage import Backend, DelegatingBackend, open_backend

if TYPE_CHECKING:
    from s3kv.store import ManifestLike

__all__ = ["CHECK_TIMEOUT", "OPERATOR_FACTOR", "BucketAccess", "PendingManifest", "StoreOpening"]

logger = logging.getLogger(__name__)

#: Longest the startup check waits to connect, and for the answer (one attempt), in seconds.
CHECK_TIMEOUT: Final = 5.0
#: A missing bucket or denied credentials are retried this many times less often.
OPERATOR_FACTOR: Final = 10.0
_FIRST_RETRY: Final = 1.0
#: Longest :meth:`StoreOpening.stop` waits for an attempt under way: the thread is a daemon,
#: and it closes what it opens after the stop.
_JOIN: Final = 1.0
#: Errors an operator fixes (bucket created, IAM policy changed): ERROR, retried rarely.
_NEEDS_OPERATOR = (BucketNotFoundError, AccessDeniedError)

M = TypeVar("M")


class BucketAccess:
    """A store's backend while it opens: usable at once, probed when the bucket answers.

    Args:
        config: The settings (endpoint, bucket, transport, ``conditional_put``).
        backend: A ready backend (tests); default: the one ``config`` names.

    Raises:
        ConfigError: no bucket configured, or a malformed ``file://`` URL.
    """

    def __init__(self, config: S3KVConfig, backend: Backend | None = None) -> None:
        self.config = config
        # NOTE: no I/O here: with conditional_put="auto" open_backend probes the bucket with
        # the configured timeouts and retries. connect() does that once the bucket answered.
        self.backend = backend if backend is not None else open_backend(_unprobed(config))
        self._checker = backend
        self._connected = backend is not None or config.conditional_put != "auto"

    def check(self) -> None:
        """HeadBucket with short timeouts and one attempt (a given backend: its own check).

        Raises:
            StorageError: the bucket did not answer, or answered with an error.
        """
        if self._checker is None:
            self._checker = open_backend(_short(self.config))
        self._checker.check()

    def connect(self, wrapper: DelegatingBackend) -> None:
        """Put the backend to keep under ``wrapper``: with ``conditional_put="auto"`` the
        capability is probed now (I/O); otherwise nothing happens.

        Raises:
            StorageError: as :func:`~s3kv.storage.open_backend`.
        """
        if self._connected:
            return
        probed = open_backend(self.config)
        replaced, wrapper.inner = wrapper.inner, probed
        self._connected = True
        replaced.close()

    def close(self) -> None:
        """Close the short check's client (not the store's backend)."""
        checker, self._checker = self._checker, None
        if checker is not None and checker is not self.backend:
            checker.close()


class _Buckets:
    """Per bucket (its description): stores pending now, and the state last logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._said: dict[str, str] = {}

    def pending(self, bucket: str) -> bool:
        with self._lock:
            return self._pending[bucket] > 0

    def enter(self, bucket: str) -> None:
        with self._lock:
            self._pending[bucket] += 1

    def leave(self, bucket: str) -> None:
        with self._lock:
            self._pending[bucket] -= 1
            if self._pending[bucket] <= 0:
                del self._pending[bucket]
                if self._said.get(bucket) != "ok":
                    # NOTE: closed while still failing: the next store of it says so again.
                    self._said.pop(bucket, None)

    def changed(self, bucket: str, state: str) -> bool:
        """Record ``state``; whether it differs from the one last logged."""
        with self._lock:
            changed = self._said.get(bucket) != state
            self._said[bucket] = state
            return changed


_BUCKETS = _Buckets()


class StoreOpening(Generic[M]):
    """Runs a store's startup steps until they succeed: first within the caller's deadline,
    then in a background thread (see the module docstring). Thread-safe.

    Args:
        check: The short bucket check run before every attempt.
        attempt: The startup steps; returns the opened manifest, raises
            :class:`~s3kv.errors.StorageError` while the bucket fails.
        bucket: The bucket's description (log lines, per-bucket state).
        retry_cap: Longest wait between attempts after a transient failure, in seconds.
        discard: Called with a manifest that opened after :meth:`stop` (closes it).
    """

    def __init__(
        self,
        check: Callable[[], None],
        attempt: Callable[[], M],
        *,
        bucket: str,
        retry_cap: float,
        discard: Callable[[M], None],
    ) -> None:
        self.bucket = bucket
        self._check = check
        self._attempt = attempt
        self._retry_cap = max(_FIRST_RETRY, retry_cap)
        self._discard = discard
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._first = threading.Event()
        self._result: M | None = None
        self._error: Exception | None = None
        self._detached = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="s3kv-open", daemon=True)

    @property
    def ready(self) -> bool:
        """Whether the startup steps succeeded."""
        return self._result is not None

    @property
    def result(self) -> M | None:
        """The opened manifest, once :attr:`ready`."""
        return self._result

    def wait(self, timeout: float) -> M | None:
        """Start; the manifest if the steps succeeded within ``timeout`` seconds, else ``None``:
        the store is pending and the steps go on in the background.

        Raises:
            Exception: what the first attempt raised, in time, when it is not a StorageError
                (a bug, or a setting that cannot work): that never heals.
        """
        # NOTE: when another store of this bucket is pending, its line said it all already.
        quiet = _BUCKETS.pending(self.bucket)
        self._thread.start()
        self._first.wait(0.0 if quiet else max(0.0, timeout))
        with self._lock:
            if self._result is not None:
                return self._result
            error = self._error
            if error is not None and not isinstance(error, StorageError):
                self._stopped = True
                raise error
            self._detached = True
            _BUCKETS.enter(self.bucket)
            if error is not None:
                self._report(error, first=True)
            elif quiet:
                logger.debug(
                    "s3kv: %s: another store of it is pending; so is this one", self.bucket
                )
            else:
                self._say(
                    "timeout",
                    logging.WARNING,
                    "s3kv: %s did not answer within %.1f s (startup_timeout); starting without "
                    "it, claiming and saving nothing until it answers (retrying in the background)",
                    self.bucket,
                    timeout,
                )
        return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :attr:`ready`, :meth:`stop` or ``timeout``; whether ready."""
        with self._changed:
            self._changed.wait_for(lambda: self._result is not None or self._stopped, timeout)
            return self._result is not None

    def stop(self, timeout: float | None = None) -> None:
        """Stop retrying; wait up to ``timeout`` seconds for an attempt under way. Idempotent."""
        with self._changed:
            if self._stopped:
                return
            self._stopped = True
            leave = self._detached and self._result is None
            self._changed.notify_all()
        if leave:
            _BUCKETS.leave(self.bucket)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN if timeout is None else min(timeout, _JOIN))

    def _run(self) -> None:
        delay = _FIRST_RETRY
        while True:
            try:
                self._check()
                manifest = self._attempt()
            except Exception as exc:  # NOTE: a thread of our own: nothing may escape it
                if not self._failed(exc):
                    return
                with self._changed:
                    if self._changed.wait_for(lambda: self._stopped, delay):
                        return
                delay = min(2 * delay, self._cap(exc))
                continue
            self._succeeded(manifest)
            return

    def _failed(self, exc: Exception) -> bool:
        """Record a failed attempt; whether to retry."""
        with self._lock:
            if self._stopped:
                return False
            if not self._detached:  # the caller is still waiting for the first attempt
                first = not self._first.is_set()
                if first:
                    self._error = exc
                    self._first.set()
                    return isinstance(exc, StorageError)
        self._report(exc, first=False)
        return True

    def _succeeded(self, manifest: M) -> None:
        with self._changed:
            if self._stopped:
                stale = True
            else:
                stale = False
                self._result = manifest
                detached = self._detached
                self._changed.notify_all()
                self._first.set()
        if stale:
            self._discard(manifest)
            return
        if detached:
            _BUCKETS.leave(self.bucket)
            self._say(
                "ok",
                logging.WARNING,
                "s3kv: %s answers; store opened in the background, claiming and saving from now on",
                self.bucket,
            )

    def _cap(self, exc: Exception) -> float:
        if isinstance(exc, StorageError) and not isinstance(exc, _NEEDS_OPERATOR):
            return self._retry_cap
        return OPERATOR_FACTOR * self._retry_cap

    def _report(self, exc: Exception, *, first: bool) -> None:
        if not isinstance(exc, StorageError):
            logger.error(
                "s3kv: opening the store of %s failed; retrying every %.0f s at most",
                self.bucket,
                self._cap(exc),
                exc_info=exc,
            )
            return
        kind = "operator" if isinstance(exc, _NEEDS_OPERATOR) else "unreachable"
        level = logging.ERROR if kind == "operator" else logging.WARNING
        what = (
            "starting without it, claiming and saving nothing until it answers"
            if first
            else "still claiming and saving nothing"
        )
        self._say(
            f"{kind}:{exc.kind}",
            level,
            "s3kv: %s; %s (retrying every %.0f s at most)",
            exc,
            what,
            self._cap(exc),
        )

    def _say(self, state: str, level: int, message: str, *args: object) -> None:
        loud = _BUCKETS.changed(self.bucket, state)
        logger.log(level if loud else logging.DEBUG, message, *args)


class PendingManifest:
    """A pending store's manifest: empty until its opening succeeds, then the opened one.

    Lookups miss and records are dropped until then (the store claims and saves nothing
    meanwhile anyway); :meth:`close` also stops the opening.

    Args:
        opening: The store's opening; its result is the manifest forwarded to.
    """

    def __init__(self, opening: StoreOpening[ManifestLike]) -> None:
        self.opening = opening

    def may_contain(self, key: bytes) -> bool:
        target = self.opening.result
        return target is not None and target.may_contain(key)

    def count_leading(self, keys: Sequence[bytes]) -> int:
        target = self.opening.result
        return 0 if target is None else target.count_leading(keys)

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        target = self.opening.result
        return np.zeros(len(keys), dtype=bool) if target is None else target.contains_many(keys)

    def record_write(self, key: BlockHash, parent: BlockHash, size: int) -> None:
        target = self.opening.result
        if target is not None:
            target.record_write(key, parent, size)

    def record_writes(self, writes: Sequence[tuple[BlockHash, BlockHash, int]]) -> None:
        target = self.opening.result
        if target is not None:
            target.record_writes(writes)

    def record_hits(self, keys: Sequence[BlockHash]) -> None:
        target = self.opening.result
        if target is not None:
            target.record_hits(keys)

    def flush(self) -> int:
        target = self.opening.result
        return 0 if target is None else target.flush()

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        self.opening.stop(timeout)
        target = self.opening.result
        if target is not None:
            target.close(flush=flush, timeout=timeout)

    def stats(self) -> dict[str, float]:
        target = self.opening.result
        return {} if target is None else target.stats()


def _unprobed(config: S3KVConfig) -> S3KVConfig:
    """``config`` for a backend opened without I/O (the probe comes later)."""
    if config.conditional_put != "auto":
        return config
    return config.replace(conditional_put="off")


def _short(config: S3KVConfig) -> S3KVConfig:
    """``config`` for the startup check: one attempt, bounded timeouts, no probe."""
    return config.replace(
        conditional_put="off",
        connect_timeout=min(config.connect_timeout, CHECK_TIMEOUT),
        read_timeout=min(config.read_timeout, CHECK_TIMEOUT),
        max_attempts=1,
    )
