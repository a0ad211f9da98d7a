"""Settings: frozen, keyword-only, validated at construction.

Every field has a default and an environment variable ``TLLM_S3KV_<FIELD>`` (upper case).
TensorRT-LLM forwards only ``TLLM*``/``TRTLLM*`` variables to its MPI workers, so these are
the names that reach every rank. A TOML file named by ``TLLM_S3KV_CONFIG`` may hold the same
fields (lower case, top level or under an ``[s3kv]`` table). Precedence, lowest first:
defaults, the TOML file, environment variables, explicit overrides.

Sizes accept integers or strings such as ``"512MiB"``/``"2GB"``; durations accept numbers of
seconds or strings such as ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

Credentials are never settings here: boto3's standard chain (environment, profile, SSO,
container and instance roles) supplies them, so they never appear in a config dump.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from s3kv.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "TLLM_S3KV_"
CONFIG_FILE_ENV = "TLLM_S3KV_CONFIG"

CodecName = Literal["planes-zstd", "zstd", "raw"]
SavePolicy = Literal["drop", "block"]
AddressingStyle = Literal["auto", "path", "virtual"]
ConditionalPut = Literal["auto", "on", "off"]

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
#: Largest size: what a signed 64-bit byte count (mmap, ctypes, torch) can hold.
MAX_SIZE = 2**63 - 1
#: Largest integer setting (a signed 64-bit value, for the same reason).
_MAX_INT = 2**63 - 1
#: Longest duration: one year. NOTE: waits and deadlines beyond ``threading.TIMEOUT_MAX``
#: raise OverflowError inside the engine, and no setting needs more than a year.
MAX_DURATION = 365 * 86400.0


class _Invalid(ValueError):
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
            raise _Invalid(f"expected a byte size like 512MiB or 2GB, got {_show(value)}")
        number = float(match.group(1)) * _SIZE_UNITS[unit]
        if not number <= MAX_SIZE:  # NOTE: also catches inf from a 400-digit number
            raise _Invalid(f"must be at most {MAX_SIZE} bytes (8 EiB), got {_show(value)}")
        return int(number)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Invalid(
            f"expected a whole number of bytes or a string like \"512MiB\", got {_show(value)}"
        )
    if not 0 <= value <= MAX_SIZE:
        raise _Invalid(f"must be in 0..{MAX_SIZE} bytes, got {value}")
    return value


def _duration_value(value: object, *, positive: bool = False) -> float:
    """Seconds from a number or a string such as ``"90s"`` or ``"7d"`` (module doc)."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if not match:
            raise _Invalid(f"expected a duration like 90s, 30m, 12h, 7d or 2w, got {_show(value)}")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) if abs(value) <= MAX_DURATION else math.copysign(math.inf, value)
        if math.isnan(seconds):
            raise _Invalid(f"expected a number of seconds or a string like 90s, got {_show(value)}")
    else:
        raise _Invalid(f"expected a number of seconds or a string like 90s, got {_show(value)}")
    if positive and not seconds > 0:
        raise _Invalid(f"must be > 0 seconds (e.g. 30s), got {_show(value)}")
    if not 0 <= seconds <= MAX_DURATION:
        raise _Invalid(f"must be in 0..{MAX_DURATION:.0f} seconds (one year), got {_show(value)}")
    return seconds


def parse_size(value: str | int, *, name: str = "size") -> int:
    """Parse a byte size such as ``4096``, ``"512MiB"`` or ``"2GB"``.

    Raises:
        ConfigError: naming ``name`` when the value is not a size in ``0..MAX_SIZE`` (a
            float, a bool, NaN or a negative number included).
    """
    try:
        return _size_value(value)
    except _Invalid as exc:
        raise ConfigError(f"{name}: {exc}") from None


def parse_duration(value: str | int | float, *, name: str = "duration") -> float:
    """Parse a duration in seconds: ``30``, ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"``.

    Raises:
        ConfigError: naming ``name`` when the value is not a duration in ``0..MAX_DURATION``
            (a bool, NaN or infinity included).
    """
    try:
        return _duration_value(value)
    except _Invalid as exc:
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
    (inclusive); ``check`` raises :class:`_Invalid` for a value of the right type."""
    meta = {"kind": "plain", "doc": doc, "choices": choices, "low": low, "high": high}
    return field(default=default, metadata={**meta, "check": check})


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
    # --- engine ---
    io_threads: int = _plain(
        8, "Threads doing GET/PUT + codec work (the one I/O pool), >= 1.", low=1
    )
    codec: CodecName = _plain(
        "planes-zstd",
        "Block codec: planes-zstd, zstd or raw.",
        choices=("planes-zstd", "zstd", "raw"),
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
        "Consecutive storage failures that open the circuit breaker (claim 0, save nothing), "
        ">= 1.",
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
        if isinstance(self.log_level, str):
            # NOTE: frozen; normalised once so that INFO, Info and info are one setting.
            object.__setattr__(self, "log_level", self.log_level.strip().lower())
        for f in fields(self):
            _validate_field(f.name, getattr(self, f.name), f.metadata)
        checks: list[tuple[bool, str]] = [
            (self.max_attempts >= 1, "max_attempts: must be >= 1"),
            (self.io_threads >= 1, "io_threads: must be >= 1"),
            (-7 <= self.compression_level <= 22, "compression_level: must be in -7..22"),
            (0.0 < self.bloom_fpr < 0.5, "bloom_fpr: must be between 0 and 0.5"),
            (self.bloom_capacity >= 1, "bloom_capacity: must be >= 1"),
            (self.max_prefetch_queue >= 1, "max_prefetch_queue: must be >= 1"),
            (self.manifest_flush_keys >= 1, "manifest_flush_keys: must be >= 1"),
            (
                self.manifest_compaction_interval > 0,
                "manifest_compaction_interval: must be > 0",
            ),
            (
                self.manifest_lease >= 3 * self.manifest_compaction_interval,
                "manifest_lease: must be >= 3 x manifest_compaction_interval",
            ),
            (self.breaker_failures >= 1, "breaker_failures: must be >= 1"),
            (0 <= self.metrics_port <= 65535, "metrics_port: must be in 0..65535"),
            ("//" not in self.prefix, "prefix: must not contain '//'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        _check_log_level(self.log_level)
        _check_address(self.metrics_address)
        self.lora_revision_map()

    def lora_revision_map(self) -> dict[int, str]:
        """``lora_revisions`` parsed: adapter revision by LoRA task id.

        Raises:
            ConfigError: A malformed entry (names the setting and the entry).
        """
        mapping: dict[int, str] = {}
        for entry in filter(None, (e.strip() for e in self.lora_revisions.split(","))):
            task, sep, revision = entry.partition("=")
            if not sep or not task.strip().isdigit() or not revision.strip():
                raise ConfigError(
                    f"lora_revisions: entry {entry!r} is not TASK_ID=REVISION "
                    "(e.g. 7=commit:4f1e...)"
                )
            mapping[int(task)] = revision.strip()
        return mapping

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
                    raise ConfigError(
                        f"{path}: unknown setting {name!r}; known: {', '.join(sorted(known))}"
                    )
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
                f"{unknown_env[0]}: unknown setting; known names are "
                f"{ENV_PREFIX}<{'|'.join(n.upper() for n in sorted(known))}>"
            )
        for name, value in overrides.items():
            if name not in known:
                raise ConfigError(f"unknown setting {name!r}")
            if value is not None:
                raw[name] = value
                sources[name] = "argument"
        coerced = {
            name: _coerce(
                name, value, known[name].type, known[name].metadata, sources.get(name, "default")
            )
            for name, value in raw.items()
        }
        return cls(**coerced), sources

    def describe(self) -> dict[str, Any]:
        """All settings as a plain dict (safe to log: there are no secrets in it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(
            f"{CONFIG_FILE_ENV}: cannot read {path}: {exc.strerror}; fix the path"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}: {path} is not valid TOML: {exc}") from exc
    table = data.get("s3kv", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [s3kv] must be a table")
    return dict(table)


def _coerce(name: str, value: Any, annotation: Any, meta: Mapping[str, Any], source: str) -> Any:
    """Turn a string/TOML value into the field's type; errors name the setting and source."""
    kind = meta.get("kind", "plain")
    where = f"{name} (from {source})"
    if kind == "size":
        return parse_size(value, name=where)
    if kind == "duration":
        return parse_duration(value, name=where)
    type_name = str(annotation)
    if not isinstance(value, str):
        return value
    if type_name.startswith("int"):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if type_name.startswith("float"):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if type_name.startswith("bool"):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if "None" in type_name and value.strip() == "":
        return None
    return value


#: Values of ``log_level`` (the ``logging`` levels by name; empty: leave the logger alone).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def _check_log_level(value: object) -> None:
    if value == "" or value in LOG_LEVELS:
        return
    raise ConfigError(
        f"log_level: must be one of {', '.join(LOG_LEVELS)} (or empty to leave the s3kv "
        f"logger to the application); got {value!r}"
    )


def _check_address(value: object) -> None:
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return
        except ValueError:
            if _HOSTNAME_RE.match(value):
                return
    raise ConfigError(
        "metrics_address: expected an IP address or host name to listen on, e.g. 127.0.0.1 "
        "(loopback) or 0.0.0.0 (every interface), without a port (that is metrics_port); "
        f"got {value!r}"
    )


def _validate_field(name: str, value: Any, meta: Mapping[str, Any]) -> None:
    choices: tuple[str, ...] = meta.get("choices", ())
    if choices and value not in choices:
        raise ConfigError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")
    kind = meta.get("kind")
    if kind in ("size", "duration") and (
        not isinstance(value, int | float) or isinstance(value, bool) or value < 0
    ):
        raise ConfigError(f"{name}: must be a non-negative number, got {value!r}")


__all__ = [
    "AddressingStyle",
    "CONFIG_FILE_ENV",
    "CodecName",
    "ConditionalPut",
    "ENV_PREFIX",
    "LOG_LEVELS",
    "S3KVConfig",
    "SavePolicy",
    "parse_duration",
    "parse_size",
]
