"""Settings: frozen, keyword-only, validated at construction.

Every field has a default and an environment variable ``TLLM_S3KV_<FIELD>`` (upper case).
TensorRT-LLM forwards only ``TLLM*``/``TRTLLM*`` variables to its MPI workers, so these are
the names that reach every rank. A TOML file named by ``TLLM_S3KV_CONFIG`` may hold the same
fields (lower case, top level or under an ``[s3kv]`` table). Precedence, lowest first:
defaults, the TOML file, environment variables, explicit overrides.

Sizes accept integers or strings such as ``"512MiB"``/``"2GB"``; durations accept numbers of
seconds or strings such as ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

Validation happens in one place, :func:`_validate_field`, whatever the source (constructor,
``replace``, TOML, environment, arguments): strings are parsed to the field's type, other
values must already have it, strictly (an integer is never a bool or a float; a number is
never a bool, NaN or infinite; a string is UTF-8 text on one line). Every failure is one
``ConfigError`` line ``"<setting>: <problem and fix> (from <source>)"``.

Credentials are never settings here: boto3's standard chain (environment, profile, SSO,
container and instance roles) supplies them, so they never appear in a config dump.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeGuard
from urllib.parse import urlsplit

from s3kv.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "TLLM_S3KV_"
CONFIG_FILE_ENV = "TLLM_S3KV_CONFIG"

CodecName = Literal["planes-zstd", "planes-ref", "zstd", "raw"]
SavePolicy = Literal["drop", "block"]
AddressingStyle = Literal["auto", "path", "virtual"]
ConditionalPut = Literal["auto", "on", "off"]
S3ClientName = Literal["auto", "boto3", "crt"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.ASCII)
#: Largest integer or size: what a signed 64-bit value (mmap, ctypes, torch) can hold.
_MAX_INT = 2**63 - 1
#: Longest duration: one year. NOTE: waits and deadlines beyond ``threading.TIMEOUT_MAX``
#: raise OverflowError inside the engine, and no setting needs more than a year.
_MAX_DURATION = 365 * 86400.0


class _RuleError(ValueError):
    """A rule a value broke (the problem only: the caller adds setting name and source)."""


def _show(value: object) -> str:
    """``value`` for a one-line message: its repr, cut short, with the type if not text."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return text if isinstance(value, str) else f"{text} ({type(value).__name__})"


def _size_value(value: object) -> int:
    """A byte size from an integer or a string such as ``"512MiB"`` (module doc)."""
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _SIZE_UNITS:
            raise _RuleError(f"expected a byte size like 512MiB or 2GB, got {_show(value)}")
        number = float(match.group(1)) * _SIZE_UNITS[unit]
        if not number <= _MAX_INT:  # NOTE: also catches inf from a 400-digit number
            raise _RuleError(f"must be at most {_MAX_INT} bytes (8 EiB), got {_show(value)}")
        return int(number)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _RuleError(
            f'expected a whole number of bytes or a string like "512MiB", got {_show(value)}'
        )
    if not 0 <= value <= _MAX_INT:
        raise _RuleError(f"must be in 0..{_MAX_INT} bytes, got {_show(value)}")
    return value


def _is_number(value: object) -> TypeGuard[int | float]:
    """An int that is not a bool, or a float that is not NaN (infinities are numbers)."""
    if isinstance(value, float):
        return not math.isnan(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _duration_value(value: object, *, positive: bool = False) -> float:
    """Seconds from a number or a string such as ``"90s"`` or ``"7d"`` (module doc)."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if not match:
            raise _RuleError(
                f"expected a duration like 90s, 30m, 12h, 7d or 2w, got {_show(value)}"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    elif _is_number(value):
        # NOTE: float() of a huge int raises OverflowError: keep only its sign.
        big = abs(value) > _MAX_DURATION
        seconds = (math.inf if value > 0 else -math.inf) if big else float(value)
    else:
        raise _RuleError(f"expected a number of seconds or a string like 90s, got {_show(value)}")
    if positive and not seconds > 0:
        raise _RuleError(f"must be > 0 seconds (e.g. 30s), got {_show(value)}")
    if not 0 <= seconds <= _MAX_DURATION:
        raise _RuleError(f"must be in 0..{_MAX_DURATION:.0f} s (one year), got {_show(value)}")
    return seconds


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Parse a byte size such as ``4096``, ``"512MiB"`` or ``"2GB"``.

    Raises:
        ConfigError: naming ``name`` when the value is not a size in 0..2^63-1 bytes (a
            float, a bool or a negative number included).
    """
    try:
        return _size_value(value)
    except _RuleError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def parse_duration(value: str | int | float, *, name: str = "duration") -> float:
    """Parse a duration in seconds: ``30``, ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

    Raises:
        ConfigError: naming ``name`` when the value is not a duration of 0 s to one year
            (a bool, NaN or infinity included).
    """
    try:
        return _duration_value(value)
    except _RuleError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _size(default: int, doc: str) -> Any:
    return field(default=default, metadata={"kind": "size", "doc": doc})


def _duration(default: float, doc: str, *, positive: bool = False) -> Any:
    meta = {"kind": "duration", "doc": doc, "positive": positive}
    return field(default=default, metadata=meta)


def _plain(
    default: Any,
    doc: str,
    *,
    choices: tuple[str, ...] = (),
    low: int | None = None,
    high: int | None = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    """A field whose kind comes from its annotation; ``low``/``high`` bound integers
    (inclusive); ``check`` raises :class:`_RuleError` for a value of the right type."""
    meta = {"kind": "plain", "doc": doc, "choices": choices, "low": low, "high": high}
    return field(default=default, metadata={**meta, "check": check})


#: GET/PUT threads per worker (the I/O pool, or each codec process) for ``io_threads = auto``.
IO_THREADS_PER_WORKER = 8
#: Threads each codec process decodes and encodes on (at most its share of ``io_threads``).
#: NOTE: why 2: ``codec_processes = auto`` runs one process per 4 CPUs of a rank's share, so
#: the codec then takes at most half of the CPUs it sized from, whatever the requests in
#: flight; the GPU A/B measured decode steps beside saves with 2 per process (4 processes).
CODEC_THREADS_PER_PROCESS = 2

#: Values of ``log_level`` (the ``logging`` levels by name; empty: leave the logger alone).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# NOTE: AWS's rules for new buckets, which MinIO, SeaweedFS and Ceph RGW also enforce.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
# NOTE: botocore's own rule (a host label, not all digits), so custom names such as
# "garage" or "minio" pass and anything botocore would refuse at the first request fails.
_REGION_RE = re.compile(r"^(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)$")
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # as s3kv.manifest.format's segment names
_MAX_PREFIX_BYTES = 512  # NOTE: object keys are at most 1024 bytes; s3kv adds up to ~200


def _check_text(value: str) -> None:
    """Every string setting: encodable as UTF-8 (S3 keys, headers, files) and on one line."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _RuleError(f"is not valid UTF-8 text, got {_show(value)}") from None
    if _CONTROL_RE.search(value):
        raise _RuleError(f"must not contain control characters (NUL, newline), got {_show(value)}")


def _check_bucket(value: str) -> None:
    if value and (not _BUCKET_RE.match(value) or ".." in value or _IPV4_RE.match(value)):
        raise _RuleError(
            f"{_show(value)} is not a valid S3 bucket name; use 3-63 lowercase letters, "
            "digits, dots and hyphens, starting and ending with a letter or digit"
        )


def _check_prefix(value: str) -> None:
    if "//" in value:
        raise _RuleError(f"must not contain '//', got {_show(value)}")
    if len(value.encode("utf-8")) > _MAX_PREFIX_BYTES:
        raise _RuleError(f"must be at most {_MAX_PREFIX_BYTES} bytes, got {_show(value)}")


def _check_endpoint(value: str) -> None:
    if not value:
        return
    # NOTE: no square brackets in messages: the doctor's table reads them as markup.
    usage = "use http(s)://HOST, optionally with :PORT and /PATH, or file:///absolute/dir"
    if value.startswith("file://"):
        if not value[len("file://") :].startswith("/"):
            raise _RuleError(
                f"a file:// endpoint needs an absolute path ({usage}), got {_show(value)}"
            )
        return
    try:
        parts = urlsplit(value)
        host, port = parts.hostname, parts.port  # NOTE: .port raises for junk or > 65535
    except ValueError:
        raise _RuleError(f"is not a URL ({usage}), got {_show(value)}") from None
    if parts.scheme not in ("http", "https") or not host or " " in value:
        raise _RuleError(f"is not an HTTP(S) URL ({usage}), got {_show(value)}")
    if parts.username is not None or parts.password is not None:
        raise _RuleError(
            "must not carry credentials (user:password@); use the AWS credential chain"
        )
    if parts.query or parts.fragment:
        raise _RuleError(f"must not have a query or fragment ({usage}), got {_show(value)}")
    if port == 0 or not _valid_host(host):
        raise _RuleError(f"has no valid host and port ({usage}), got {_show(value)}")


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOSTNAME_RE.match(host.removesuffix(".")) is not None


def _check_region(value: str) -> None:
    if value and not _REGION_RE.match(value):
        raise _RuleError(
            f"{_show(value)} is not a region name; use e.g. us-east-1, or the name your "
            "S3 server expects (letters, digits and hyphens)"
        )


def _check_instance_id(value: str) -> None:
    if value and not _INSTANCE_RE.match(value):
        raise _RuleError(
            f"must be empty (random) or 1-64 letters, digits, '.', '_' and '-', got {_show(value)}"
        )


def _check_fpr(value: float) -> None:
    if not 0.0 < value < 0.5:
        raise _RuleError(f"must be between 0 and 0.5 (e.g. 1e-6), got {_show(value)}")


def _check_log_level(value: str) -> None:
    if value and value not in LOG_LEVELS:
        raise _RuleError(
            f"must be one of {', '.join(LOG_LEVELS)} (or empty to leave the s3kv logger to "
            f"the application); got {_show(value)}"
        )


def _check_address(value: str) -> None:
    if not _valid_host(value):
        raise _RuleError(
            "expected an IP address or host name to listen on, e.g. 127.0.0.1 (loopback) or "
            "0.0.0.0 (every interface), without a port (that is metrics_port); "
            f"got {_show(value)}"
        )


def _lora_map(value: str) -> dict[int, str]:
    mapping: dict[int, str] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        task, sep, revision = (part.strip() for part in entry.partition("="))
        if not sep or not (task.isascii() and task.isdigit()) or not revision:
            raise _RuleError(
                f"entry {_show(entry)} is not TASK_ID=REVISION (e.g. 7=commit:4f1e...)"
            )
        mapping[int(task)] = revision
    return mapping


def _check_lora(value: str) -> None:
    _lora_map(value)


_CPU_LIST_RE = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$", re.ASCII)
_MAX_CPU = 1 << 16  # NOTE: above Linux's largest NR_CPUS (8192); bounds a typo's set


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs named by a list such as ``0-3,8,10-11`` (Linux's cpulist format; spaces ignored).

    Raises:
        ValueError: one line saying what is wrong and what the format is.
    """
    compact = text.replace(" ", "")
    if not _CPU_LIST_RE.match(compact):
        raise ValueError(f"expected a CPU list like 8-15 or 4,5,12-15, got {_show(text)}")
    cpus: set[int] = set()
    for part in compact.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low > high or high >= _MAX_CPU:
            raise ValueError(f"CPU range {part!r} is empty or beyond CPU {_MAX_CPU - 1}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def _check_cpus(value: str) -> None:
    if value not in ("auto", "inherit"):
        try:
            parse_cpu_list(value)
        except ValueError as exc:
            raise _RuleError(f"must be auto, inherit or a CPU list: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class S3KVConfig:
    """All s3kv settings. Memory cost of the bounded resources is stated per field."""

    # --- where ---
    bucket: str = _plain(
        "",
        "Bucket holding the KV objects (required to open S3): 3-63 lowercase letters, digits, "
        "dots and hyphens, starting and ending with a letter or digit.",
        check=_check_bucket,
    )
    prefix: str = _plain(
        "s3kv",
        "Key prefix inside the bucket; all objects live below it (at most 512 bytes, no '//').",
        check=_check_prefix,
    )
    endpoint_url: str | None = _plain(
        None,
        "S3 endpoint: http(s)://host[:port][/path] (MinIO, SeaweedFS, Ceph) or "
        "file:///absolute/dir; default: AWS_ENDPOINT_URL_S3 or AWS.",
        check=_check_endpoint,
    )
    region: str | None = _plain(
        None,
        "AWS region (us-east-1, or a custom name such as garage); default: the credential "
        "chain's region.",
        check=_check_region,
    )
    profile: str | None = _plain(None, "AWS shared-config profile name.")
    addressing_style: AddressingStyle = _plain(
        "auto",
        "S3 addressing: auto, path (MinIO/SeaweedFS/Ceph) or virtual.",
        choices=("auto", "path", "virtual"),
    )
    ca_bundle: str | None = _plain(None, "Path to a CA bundle for a private TLS endpoint.")
    # --- security ---
    auth_keys: str = _plain(
        "",
        "Where the block authentication keys are (never the keys themselves): "
        "'file:/path', 'env:VARIABLE' or 'kms:/path' (data keys encrypted under AWS KMS). "
        "Set, every block is sealed (AES-256-GCM, bound to its key) and a block that is not "
        "sealed by a listed key is a miss. Empty: blocks are not authenticated.",
    )
    auth_accept_unsigned: bool = _plain(
        False,
        "With auth_keys set, still read blocks written without authentication (only while "
        "migrating a bucket that has them; it reopens the door auth_keys closes).",
    )
    # --- transport ---
    connect_timeout: float = _duration(
        5.0, "TCP connect timeout per attempt, > 0 (0 would fail every request).", positive=True
    )
    read_timeout: float = _duration(
        30.0, "Socket read timeout per attempt, > 0 (0 would fail every request).", positive=True
    )
    max_attempts: int = _plain(3, "Attempts per request (standard retry mode), >= 1.", low=1)
    conditional_put: ConditionalPut = _plain(
        "auto",
        "Use If-None-Match on block PUTs: auto (probe once), on, off.",
        choices=("auto", "on", "off"),
    )
    s3_client: S3ClientName = _plain(
        "auto",
        "Client for object GET/PUT: auto (awscrt when installed, else boto3), boto3, or crt "
        "(needs the crt extra); listing, HEAD and deletes always use boto3.",
        choices=("auto", "boto3", "crt"),
    )
    # --- engine ---
    io_threads: int | Literal["auto"] = _plain(
        "auto",
        "GET/PUT requests at once, >= 1, or auto: the I/O pool's threads (GET/PUT + codec "
        "work), or with codec_processes the processes' request threads in all (each process "
        f"codes on at most {CODEC_THREADS_PER_PROCESS} more). auto: {IO_THREADS_PER_WORKER} "
        f"in the I/O pool, {IO_THREADS_PER_WORKER} per codec process (a GET waits a round "
        "trip at least: a long link needs many in flight).",
        low=1,
    )
    codec_processes: int | Literal["auto"] = _plain(
        "auto",
        "Processes doing block GET/PUT and codec work, 0..64, or auto; 0 does it in the I/O "
        "threads. Off the engine's interpreter, they neither slow its forward loop nor share "
        f"its GIL (io_threads is then the total GET/PUT concurrency; each codes on at most "
        f"{CODEC_THREADS_PER_PROCESS} threads). auto: where the KV cache "
        "is on a GPU, one per 4 CPUs of the rank's share of the host, at most 4 a rank "
        "(s3kv.offload.sizing); elsewhere 0.",
        low=0,
        high=64,
    )
    codec_cpus: str = _plain(
        "auto",
        "CPUs of the codec processes: auto (the engine's CPUs where they leave room, else the "
        "CPUs outside them), inherit (the engine's), or a list like 8-15 or 4,5,12-15.",
        check=_check_cpus,
    )
    codec: CodecName = _plain(
        "planes-zstd",
        "Block codec: planes-zstd, planes-ref (planes-zstd with each exponent byte coded "
        "against its channel's largest over the block's tokens: needs the connector's 5-D "
        "block shape, else planes-zstd), zstd or raw.",
        choices=("planes-zstd", "planes-ref", "zstd", "raw"),
    )
    compression_level: int = _plain(
        1, "zstd level, -7..22; 1 measured best on KV byte planes.", low=-7, high=22
    )
    staging_bytes: int = _size(
        2 * 1024**3, "Host staging cache budget (decoded blocks; pinned memory under CUDA)."
    )
    max_inflight_save_bytes: int = _size(
        512 * 1024**2, "Raw bytes of saves queued or uploading; beyond it save_policy applies."
    )
    save_policy: SavePolicy = _plain(
        "drop",
        "When save bytes are at the bound: drop (count it) or block (wait).",
        choices=("drop", "block"),
    )
    save_block_timeout: float = _duration(
        5.0, "Longest a save waits under save_policy=block (0: drop at once, as drop does)."
    )
    max_prefetch_queue: int = _plain(
        4096, "Prefetches queued at once, >= 1; more are dropped.", low=1
    )
    close_timeout: float = _duration(
        30.0, "Deadline for draining saves on close() (0: drop queued saves at once)."
    )
    startup_timeout: float = _duration(
        10.0,
        "Longest engine startup waits for the bucket; past it the connector starts without it "
        "(claims and saves nothing) and keeps opening it in the background.",
    )
    # --- manifest ---
    bloom_capacity: int = _plain(
        1_000_000,
        "Keys of the first growth partition of the key filter (it grows past it), 1..2^32.",
        low=1,
        high=2**32,
    )
    bloom_fpr: float = _plain(
        1e-6, "Target false-positive rate of the key filter (0 < p < 0.5).", check=_check_fpr
    )
    manifest_refresh_interval: float = _duration(
        10.0, "How often the manifest log is checked for news (0 disables)."
    )
    manifest_flush_interval: float = _duration(
        60.0, "How often new keys are flushed (0: only by manifest_flush_keys and at close)."
    )
    manifest_flush_keys: int = _plain(
        4096, "Flush a segment early once this many records wait, >= 1.", low=1
    )
    manifest_hit_interval: float = _duration(
        600.0, "Hits alone are flushed at most this often (coalesced per key)."
    )
    manifest_compaction: Literal["auto", "off"] = _plain(
        "auto",
        "Take part in electing the one compactor per model: auto (needs conditional PUT), off.",
        choices=("auto", "off"),
    )
    manifest_compaction_interval: float = _duration(
        20.0, "How often the compactor folds segments into a delta, > 0.", positive=True
    )
    manifest_lease: float = _duration(
        60.0, "Another instance takes compaction over after this long without news."
    )
    manifest_open_timeout: float = _duration(
        10.0, "Longest the manifest load holds up startup; it finishes in the background."
    )
    instance_id: str = _plain(
        "",
        "Name of this instance in segment keys (1-64 letters, digits, '.', '_', '-'); "
        "default random.",
        check=_check_instance_id,
    )
    # --- connector ---
    model_revision: str = _plain(
        "",
        "Immutable weights revision for the model fingerprint (commit or checksum); "
        "when empty s3kv derives it from llm_args or hashes the weight files, else fails "
        "closed (blocks are not shared).",
    )
    warm_start_bytes: int = _size(
        512 * 1024**2, "Staging budget filled at startup with the hottest and pinned prefixes."
    )
    warm_start_timeout: float = _duration(60.0, "Longest startup waits for warm staging.")
    save_decode_blocks: bool = _plain(False, "Also save blocks filled during decode.")
    lora_revisions: str = _plain(
        "",
        "Immutable adapter revision per LoRA task id, as 'ID=REVISION,...' (e.g. "
        "'7=commit:4f1e...,9=sha256:ab12...'). Task ids are numbers each deployment assigns, "
        "so LoRA requests whose id is not listed are neither claimed nor saved.",
        check=_check_lora,
    )
    breaker_failures: int = _plain(
        5,
        "Consecutive storage failures that open the circuit breaker (claim 0, save nothing), >= 1.",
        low=1,
    )
    breaker_cooldown: float = _duration(30.0, "Time the breaker stays open before a probe.")
    # --- observability ---
    metrics_port: int = _plain(
        0,
        "Serve Prometheus metrics on this port (0 = do not serve); one endpoint per process "
        "(under TP rank r > 0 serves on this port + r).",
        low=0,
        high=65535,
    )
    metrics_address: str = _plain(
        "127.0.0.1",
        "Address the metrics endpoint listens on: loopback by default; 0.0.0.0 or :: for a "
        "scraper on another host or pod.",
        check=_check_address,
    )
    log_level: str = _plain(
        "",
        "Level of the 's3kv' logger, set when a store opens: debug, info, warning, error or "
        "critical; empty leaves it to the application's logging setup.",
        check=_check_log_level,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            # NOTE: frozen; each value stored once normalised (float seconds, lower-case
            # log_level), so that equal settings compare equal.
            object.__setattr__(self, f.name, _validate_field(f.name, getattr(self, f.name)))
        if not self.manifest_lease >= 3 * self.manifest_compaction_interval:
            raise ConfigError(
                f"manifest_lease: must be >= 3 x manifest_compaction_interval "
                f"({3 * self.manifest_compaction_interval:g} s), got {self.manifest_lease:g} s"
            )

    def io_concurrency(self, processes: int = 0) -> int:
        """GET/PUT requests at once with ``processes`` codec processes (0: the I/O pool's
        threads): ``io_threads``, or for ``auto`` :data:`IO_THREADS_PER_WORKER` per worker.
        With processes a number is split over them, each making at least one and the same
        share (so 5 over 4 processes is 8): a multiple of ``processes``.

        Why 8 per codec process: a block GET waits a round trip at least, so on a 10 Gbit/s
        link 10 ms away 8 GETs at once staged 610 MB/s of blocks and 32 (4 processes of 8)
        1,303-1,460 MB/s, where 64 gave no more (README, WAN figures)."""
        workers = max(1, processes)
        if not isinstance(self.io_threads, int):
            return IO_THREADS_PER_WORKER * workers
        return -(-self.io_threads // workers) * workers

    def lora_revision_map(self) -> dict[int, str]:
        """``lora_revisions`` parsed: adapter revision by LoRA task id (valid once built)."""
        return _lora_map(self.lora_revisions)

    @property
    def key_prefix(self) -> str:
        """The prefix without leading/trailing slashes ('' for the bucket root)."""
        return self.prefix.strip("/")

    def replace(self, **changes: Any) -> S3KVConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def env_name(cls, field_name: str) -> str:
        """The environment variable that sets ``field_name``."""
        return ENV_PREFIX + field_name.upper()

    @classmethod
    def load(
        cls,
        *,
        environ: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> S3KVConfig:
        """Build the config from defaults, the TOML file, the environment and ``overrides``.

        Args:
            environ: Environment to read (default ``os.environ``).
            config_file: TOML file; default the path in ``TLLM_S3KV_CONFIG``, if set.
            overrides: Field values that win over everything else (``None`` is ignored).

        Raises:
            ConfigError: an unknown setting, an unreadable file, or an invalid value; the
                message names the setting and where it came from.
        """
        values, _ = cls.load_with_sources(environ=environ, config_file=config_file, **overrides)
        return values

    @classmethod
    def load_with_sources(
        cls,
        *,
        environ: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        **overrides: Any,
    ) -> tuple[S3KVConfig, dict[str, str]]:
        """Like :meth:`load`, also returning where each non-default setting came from."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        raw: dict[str, Any] = {}
        sources: dict[str, str] = {}
        path = config_file if config_file is not None else env.get(CONFIG_FILE_ENV)
        if path:
            for name, value in _read_toml(Path(path)).items():
                if name not in known:
                    raise ConfigError(f"{path}: {_unknown_setting(name, known)}")
                raw[name] = value
                sources[name] = f"file {path}"
        for name in known:
            env_name = cls.env_name(name)
            if env_name in env:
                raw[name] = env[env_name]
                sources[name] = f"env {env_name}"
        unknown_env = sorted(
            k
            for k in env
            if k.startswith(ENV_PREFIX)
            and k != CONFIG_FILE_ENV
            and k[len(ENV_PREFIX) :].lower() not in known
        )
        if unknown_env:
            raise ConfigError(
                f"{unknown_env[0]}: "
                + _unknown_setting(unknown_env[0][len(ENV_PREFIX) :].lower(), known, ENV_PREFIX)
            )
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(_unknown_setting(name, known))
            if value is not None:
                raw[name] = value
                sources[name] = "argument"
        checked = {name: _validate_field(name, value, sources[name]) for name, value in raw.items()}
        return cls(**checked), sources

    def describe(self) -> dict[str, Any]:
        """All settings as a plain dict (safe to log: there are no secrets in it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _unknown_setting(name: str, known: Mapping[str, object], prefix: str = "") -> str:
    """One short line for a setting that does not exist: the nearest names, else where the
    list is (every setting listed would make a line of 800 characters)."""
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if near:
        hint = "did you mean " + " or ".join(f"{prefix}{n.upper() if prefix else n}" for n in near)
    else:
        hint = "the README's Configuration section lists every setting"
    return f"unknown setting {name!r}; {hint}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"{CONFIG_FILE_ENV}: cannot read {path}: {exc.strerror}; fix the path"
        ) from exc
    except UnicodeDecodeError:
        raise ConfigError(
            f"{CONFIG_FILE_ENV}: {path} is not UTF-8 text (a binary file?); name a TOML file"
        ) from None
    except ValueError as exc:  # NOTE: a NUL in the path; TOMLDecodeError is one too
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path} is not valid TOML: {detail}") from None
    table = data.get("s3kv", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [s3kv] must be a table")
    return dict(table)


#: Each field's kind by annotation; sizes and durations say theirs in the metadata.
_ANNOTATION_KINDS = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "str | None": "optional-str",
    "int | Literal['auto']": "int-or-auto",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _kind(f: dataclasses.Field[Any]) -> str:
    kind: str = f.metadata.get("kind", "plain")
    if kind != "plain":
        return kind
    if f.metadata.get("choices"):
        return "choice"
    if str(f.type) not in _ANNOTATION_KINDS:
        raise TypeError(f"S3KVConfig.{f.name}: no validation rule for {f.type!r}")
    return _ANNOTATION_KINDS[str(f.type)]


_FIELDS = {f.name: f for f in fields(S3KVConfig)}
_KINDS = {name: _kind(f) for name, f in _FIELDS.items()}  # NOTE: fails at import, not later


def _validate_field(name: str, value: Any, source: str = "") -> Any:
    """The one validation of a setting: ``value`` of field ``name``, normalised.

    Strings (environment variables, CLI flags, TOML strings) are parsed to the field's
    type; everything else must already have it, strictly: an integer is never a bool or a
    float, a number is never a bool, NaN or infinite, a string is valid UTF-8 without
    control characters. Then the field's range and ``check`` apply.

    Raises:
        ConfigError: ``"<name>: <problem and fix>"``, plus ``" (from <source>)"`` if given.
    """
    f = _FIELDS[name]
    try:
        return _normalise(f, _KINDS[name], value)
    except _RuleError as exc:
        where = f" (from {source})" if source else ""
        raise ConfigError(f"{name}: {exc}{where}") from None


def _normalise(f: dataclasses.Field[Any], kind: str, value: Any) -> Any:
    meta = f.metadata
    if kind == "size":
        return _size_value(value)
    if kind == "duration":
        return _duration_value(value, positive=meta["positive"])
    if kind == "optional-str" and (value is None or (isinstance(value, str) and not value.strip())):
        return None
    if kind == "int-or-auto" and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if kind in ("int", "int-or-auto"):
        value = _integer(value, auto=kind == "int-or-auto")
        low, high = meta["low"], meta["high"]
        if (low is not None and value < low) or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            either = " or auto" if kind == "int-or-auto" else ""
            raise _RuleError(f"must be {bound}{either}, got {value}")
    elif kind == "float":
        if isinstance(value, str):
            value = _parse(float, value, "a number")
        if not _is_number(value) or not -_MAX_INT <= value <= _MAX_INT:
            raise _RuleError(f"expected a finite number, got {_show(value)}")
        value = float(value)
    elif kind == "bool":
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            value = value.strip().lower() in _TRUE
        if not isinstance(value, bool):
            raise _RuleError(f"expected true or false, got {_show(value)}")
    else:  # str, optional-str, choice
        if not isinstance(value, str):
            raise _RuleError(f"expected a string, got {_show(value)}")
        _check_text(value)
        if f.name == "log_level":
            value = value.strip().lower()  # NOTE: INFO, Info and info are one setting
        choices: tuple[str, ...] = meta["choices"]
        if choices and value not in choices:
            raise _RuleError(f"must be one of {', '.join(choices)}; got {_show(value)}")
    check: Callable[[Any], None] | None = meta["check"]
    if check is not None:
        check(value)
    return value


def _integer(value: Any, *, auto: bool = False) -> int:
    expected = "an integer or auto" if auto else "an integer"
    if isinstance(value, str):
        value = _parse(int, value, expected)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _RuleError(f"expected {expected}, got {_show(value)}")
    if not -_MAX_INT <= value <= _MAX_INT:
        raise _RuleError(f"must be at most {_MAX_INT} in size, got {_show(value)}")
    return value


def _parse(parse: Callable[[str], Any], text: str, what: str) -> Any:
    try:
        return parse(text.strip())
    except ValueError:  # NOTE: int() refuses more than 4300 digits with a ValueError too
        raise _RuleError(f"expected {what}, got {_show(text)}") from None


__all__ = [
    "AddressingStyle",
    "CONFIG_FILE_ENV",
    "CodecName",
    "ConditionalPut",
    "ENV_PREFIX",
    "CODEC_THREADS_PER_PROCESS",
    "IO_THREADS_PER_WORKER",
    "LOG_LEVELS",
    "S3KVConfig",
    "SavePolicy",
    "parse_cpu_list",
    "parse_duration",
    "parse_size",
]
