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
            "TLLM_S3KV_BUCKET": "kv",
            "TLLM_S3KV_STAGING_BYTES": "512MiB",
            "TLLM_S3KV_MANIFEST_REFRESH_INTERVAL": "2m",
            "TLLM_S3KV_IO_THREADS": "4",
            "TLLM_S3KV_BLOOM_FPR": "1e-9",
            "TLLM_S3KV_ENDPOINT_URL": "",
        }
    )
    assert cfg.bucket == "kv"
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
        ({"TLLM_S3KV_IO_THREADS": "many"}, "io_threads (from env TLLM_S3KV_IO_THREADS)"),
        ({"TLLM_S3KV_STAGING_BYTES": "lots"}, "staging_bytes"),
        ({"TLLM_S3KV_CODEC": "gzip"}, "codec: must be one of planes-zstd, zstd, raw"),
        ({"TLLM_S3KV_BLOOM_FPR": "0.9"}, "bloom_fpr"),
        ({"TLLM_S3KV_IO_THREADS": "0"}, "io_threads: must be >= 1"),
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
