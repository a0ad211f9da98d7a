"""Settings: defaults, environment, TOML file, precedence and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from s3kv.config import S3KVConfig, parse_duration, parse_size
from s3kv.errors import ConfigError


def test_defaults_are_valid() -> None:
    cfg = S3KVConfig.load(environ={})
    assert cfg.prefix == "s3kv"
    assert cfg.codec == "planes-zstd"
    assert cfg.compression_level == 1
    assert cfg.staging_bytes == 2 * 1024**3


def test_environment_overrides_defaults() -> None:
    cfg = S3KVConfig.load(
        environ={
            "TLLM_S3KV_BUCKET": "kv-bucket",
            "TLLM_S3KV_STAGING_BYTES": "512MiB",
            "TLLM_S3KV_MANIFEST_REFRESH_INTERVAL": "2m",
            "TLLM_S3KV_IO_THREADS": "4",
            "TLLM_S3KV_BLOOM_FPR": "1e-9",
            "TLLM_S3KV_ENDPOINT_URL": "",
        }
    )
    assert cfg.bucket == "kv-bucket"
    assert cfg.staging_bytes == 512 * 1024**2
    assert cfg.manifest_refresh_interval == 120.0
    assert cfg.io_threads == 4
    assert cfg.bloom_fpr == 1e-9
    assert cfg.endpoint_url is None


def test_toml_file_then_env_then_arguments(tmp_path: Path) -> None:
    path = tmp_path / "s3kv.toml"
    path.write_text('[s3kv]\nbucket = "from-file"\nprefix = "team"\nio_threads = 3\n')
    cfg, sources = S3KVConfig.load_with_sources(
        environ={"TLLM_S3KV_CONFIG": str(path), "TLLM_S3KV_PREFIX": "env-prefix"},
        io_threads=5,
    )
    assert (cfg.bucket, cfg.prefix, cfg.io_threads) == ("from-file", "env-prefix", 5)
    assert sources["bucket"] == f"file {path}"
    assert sources["prefix"] == "env TLLM_S3KV_PREFIX"
    assert sources["io_threads"] == "argument"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TLLM_S3KV_IO_THREADS": "many"}, "io_threads: expected an integer or auto, got 'many'"),
        ({"TLLM_S3KV_STAGING_BYTES": "lots"}, "staging_bytes"),
        ({"TLLM_S3KV_CODEC": "gzip"}, "codec: must be one of planes-zstd, planes-ref, zstd, raw"),
        ({"TLLM_S3KV_BLOOM_FPR": "0.9"}, "bloom_fpr"),
        ({"TLLM_S3KV_IO_THREADS": "0"}, "io_threads: must be >= 1 or auto"),
        ({"TLLM_S3KV_BUCKTE": "typo"}, "TLLM_S3KV_BUCKTE: unknown setting"),
        ({"TLLM_S3KV_CLOSE_TIMEOUT": "soon"}, "close_timeout"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        S3KVConfig.load(environ=env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("bucket = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
    with pytest.raises(ConfigError, match="cannot read"):
        S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(tmp_path / "missing.toml")})
    path.write_text('buckt = "x"\n')
    with pytest.raises(ConfigError, match="unknown setting 'buckt'"):
        S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})


def test_an_unknown_setting_is_one_short_line_naming_the_nearest(tmp_path: Path) -> None:
    path = tmp_path / "s3kv.toml"
    cases = [
        ("codec_proceses = 2\n", "unknown setting 'codec_proceses'; did you mean codec_processes"),
        ("0 = 0\n", "unknown setting '0'; the README's Configuration section lists every"),
    ]
    for text, expected in cases:
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
        assert expected in str(info.value)
        assert len(str(info.value)) < 200  # NOTE: it listed all 49 settings: 842 characters
    with pytest.raises(ConfigError, match="did you mean TLLM_S3KV_STAGING_BYTES"):
        S3KVConfig.load(environ={"TLLM_S3KV_STAGING_BYTE": "1GiB"})
    with pytest.raises(ConfigError, match="unknown setting 'io_thread'; did you mean io_threads"):
        S3KVConfig.load(environ={}, io_thread=2)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600), (5, 5)],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["7 days", "-1", "1y", "", "d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"), [("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), ("1k", 1000), (7, 7)]
)
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


def test_describe_has_no_credentials() -> None:
    described = S3KVConfig.load(environ={"AWS_SECRET_ACCESS_KEY": "hunter2"}).describe()
    assert "hunter2" not in repr(described)


# ----------------------------------------------------------------------------------------
# Issue 12, items 7 and 8: every bad value is a one-line ConfigError naming the setting
# ----------------------------------------------------------------------------------------

#: (TOML line, the setting the error must name): values that raised OverflowError/TypeError,
#: or loaded and failed later (urllib3 ValueError at the first request), before issue 12.
BAD_TOML = [
    ("staging_bytes = inf", "staging_bytes"),
    ("staging_bytes = nan", "staging_bytes"),
    ("staging_bytes = 1.5", "staging_bytes"),
    ("staging_bytes = true", "staging_bytes"),
    ("prefix = 5", "prefix"),
    ("bucket = 5", "bucket"),
    ('bucket = ["a"]', "bucket"),
    ("endpoint_url = 7", "endpoint_url"),
    ("io_threads = 3.5", "io_threads"),
    ("io_threads = 4.0", "io_threads"),
    ("io_threads = true", "io_threads"),
    ("io_threads = inf", "io_threads"),
    ("metrics_port = 1e3", "metrics_port"),
    ("connect_timeout = nan", "connect_timeout"),
    ("connect_timeout = inf", "connect_timeout"),
    ("connect_timeout = 0", "connect_timeout"),
    ("read_timeout = 0", "read_timeout"),
    ("read_timeout = false", "read_timeout"),
    ("close_timeout = -inf", "close_timeout"),
    ("close_timeout = 1e300", "close_timeout"),
    ("bloom_fpr = nan", "bloom_fpr"),
    ("bloom_fpr = true", "bloom_fpr"),
    ("save_decode_blocks = 1", "save_decode_blocks"),
    ("codec = 1", "codec"),
    ("log_level = 10", "log_level"),
    ("region = 1", "region"),
    ("manifest_lease = 1979-05-27", "manifest_lease"),
    ("lora_revisions = { a = 1 }", "lora_revisions"),
]


@pytest.mark.parametrize(("line", "setting"), BAD_TOML)
def test_bad_toml_values_are_config_errors_naming_the_setting(
    tmp_path: Path, line: str, setting: str
) -> None:
    path = tmp_path / "s3kv.toml"
    path.write_text(f"[s3kv]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
    message = str(info.value)
    assert message.startswith(f"{setting}: "), message
    assert message.endswith(f" (from file {path})"), message
    assert "\n" not in message


BAD_ENV = [
    ("READ_TIMEOUT", "0", "read_timeout"),
    ("CONNECT_TIMEOUT", "0s", "connect_timeout"),
    ("CONNECT_TIMEOUT", "nan", "connect_timeout"),
    ("BLOOM_FPR", "nan", "bloom_fpr"),
    ("BLOOM_FPR", "inf", "bloom_fpr"),
    ("STAGING_BYTES", "9" * 400 + "GB", "staging_bytes"),
    ("STAGING_BYTES", "99999999999TiB", "staging_bytes"),
    ("CLOSE_TIMEOUT", "9" * 400, "close_timeout"),
    ("IO_THREADS", "true", "io_threads"),
    ("IO_THREADS", "2.0", "io_threads"),
    ("IO_THREADS", "9" * 5000, "io_threads"),
    ("ENDPOINT_URL", "notaurl", "endpoint_url"),
    ("ENDPOINT_URL", "ftp://minio:9000", "endpoint_url"),
    ("ENDPOINT_URL", "http://", "endpoint_url"),
    ("ENDPOINT_URL", "http://minio:notaport", "endpoint_url"),
    ("ENDPOINT_URL", "http://minio:99999", "endpoint_url"),
    ("ENDPOINT_URL", "http://key:secret@minio:9000", "endpoint_url"),
    ("ENDPOINT_URL", "http://minio:9000/?x=1", "endpoint_url"),
    ("ENDPOINT_URL", "http://bad host:9000", "endpoint_url"),
    ("ENDPOINT_URL", "file://relative/dir", "endpoint_url"),
    ("BUCKET", "Bad Bucket", "bucket"),
    ("BUCKET", "b", "bucket"),
    ("BUCKET", "UPPER", "bucket"),
    ("BUCKET", "-dash-first", "bucket"),
    ("BUCKET", "two..dots", "bucket"),
    ("BUCKET", "192.168.0.1", "bucket"),
    ("BUCKET", "x" * 64, "bucket"),
    ("REGION", "us east 1", "region"),
    ("REGION", "us/east", "region"),
    ("REGION", "-us-east-1", "region"),
    ("PREFIX", "a\x00b", "prefix"),
    ("PREFIX", "a\nb", "prefix"),
    ("PREFIX", "\udcff", "prefix"),
    ("PREFIX", "p" * 600, "prefix"),
    ("PROFILE", "dev\x00", "profile"),
    ("INSTANCE_ID", "has/slash", "instance_id"),
    ("LORA_REVISIONS", "\u00b2=commit:abc", "lora_revisions"),
]


@pytest.mark.parametrize(("suffix", "value", "setting"), BAD_ENV)
def test_bad_environment_values_are_config_errors_naming_the_setting(
    suffix: str, value: str, setting: str
) -> None:
    name = f"TLLM_S3KV_{suffix}"
    with pytest.raises(ConfigError) as info:
        S3KVConfig.load(environ={name: value})
    message = str(info.value)
    assert message.startswith(f"{setting}: "), message
    assert message.endswith(f" (from env {name})"), message
    assert "\n" not in message
    assert len(message) < 400


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"staging_bytes": float("inf")}, "staging_bytes"),
        ({"staging_bytes": 2**64}, "staging_bytes"),
        ({"io_threads": True}, "io_threads"),
        ({"io_threads": 2.0}, "io_threads"),
        ({"prefix": 5}, "prefix"),
        ({"bucket": b"kv-bucket"}, "bucket"),
        ({"read_timeout": 0}, "read_timeout"),
        ({"connect_timeout": float("nan")}, "connect_timeout"),
        ({"metrics_port": 80.0}, "metrics_port"),
        ({"save_decode_blocks": 1}, "save_decode_blocks"),
        ({"endpoint_url": "minio:9000"}, "endpoint_url"),
    ],
)
def test_constructor_and_replace_validate_types_strictly(
    changes: dict[str, object], setting: str
) -> None:
    with pytest.raises(ConfigError) as built:
        S3KVConfig(**changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as replaced:
        S3KVConfig().replace(**changes)
    for info in (built, replaced):
        assert str(info.value).startswith(f"{setting}:"), str(info.value)


def test_overrides_name_the_setting_and_the_argument() -> None:
    with pytest.raises(ConfigError, match=r"^staging_bytes: .* \(from argument\)$"):
        S3KVConfig.load(environ={}, staging_bytes=float("inf"))
    with pytest.raises(
        ConfigError, match=r"^io_threads: must be >= 1 or auto, got 0 \(from argument\)$"
    ):
        S3KVConfig.load(environ={}, io_threads=0)


@pytest.mark.parametrize(
    "content",
    [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", b'bucket = "kv\xff"\n', b"\x00\x01\x02"],
)
def test_a_binary_config_file_is_a_config_error_naming_the_file(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "s3kv.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"endpoint_url": "http://127.0.0.1:9000"}, "http://127.0.0.1:9000"),
        ({"endpoint_url": "https://minio.internal"}, "https://minio.internal"),
        ({"endpoint_url": "https://s3.example.com:8443/gateway/"}, None),
        ({"endpoint_url": "http://[::1]:9000"}, None),
        ({"endpoint_url": "file:///var/lib/s3kv"}, None),
        ({"region": "us-east-1"}, None),
        ({"region": "garage"}, None),
        ({"region": "eu-central-1"}, None),
        ({"bucket": "my.bucket-01"}, None),
        ({"bucket": "abc"}, None),
        ({"bucket": ""}, None),
        ({"connect_timeout": 1}, None),
        ({"close_timeout": 0}, None),
        ({"bloom_fpr": 1e-9}, None),
    ],
)
def test_valid_values_load(changes: dict[str, object], expected: object) -> None:
    cfg = S3KVConfig(**changes)  # type: ignore[arg-type]
    name, value = next(iter(changes.items()))
    assert getattr(cfg, name) == (value if expected is None else expected)


def test_numbers_are_normalised_to_their_field_type() -> None:
    cfg = S3KVConfig(connect_timeout=1, bloom_fpr=1e-6)
    assert isinstance(cfg.connect_timeout, float)
    assert cfg.replace(read_timeout=2).read_timeout == 2.0


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"TLLM_S3KV_READ_TIMEOUT": "0"}, "read_timeout"),  # was a traceback (urllib3)
        ({"TLLM_S3KV_ENDPOINT_URL": "notaurl"}, "endpoint_url"),  # was a traceback (botocore)
        ({"TLLM_S3KV_ENDPOINT_URL": "ftp://minio:9000"}, "endpoint_url"),  # was exit 1
        ({"TLLM_S3KV_REGION": "us east"}, "region"),  # was exit 1, a network error
        ({"TLLM_S3KV_BUCKET": "Bad Bucket"}, "bucket"),
        ({"TLLM_S3KV_CONNECT_TIMEOUT": "nan"}, "connect_timeout"),
    ],
)
def test_the_cli_exits_2_with_one_line_naming_the_setting(
    env: dict[str, str], setting: str
) -> None:
    from cli_support import assert_one_error_line, invoke

    from s3kv.cli.context import Runtime

    environ = {"TLLM_S3KV_BUCKET": "kv-bucket", **env}
    result = invoke(["stats"], runtime=Runtime(environ=environ))
    line = assert_one_error_line(result, f"Error: {setting}: ", code=2)
    assert f"(from env {next(iter(env))})" in line
