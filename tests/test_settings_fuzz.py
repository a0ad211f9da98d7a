"""Settings fuzz (issue 12, items 7 and 8): every field, every entry point, hostile values.

The invariant, whatever the value and wherever it comes from (constructor, ``replace``,
explicit arguments, ``TLLM_S3KV_*`` variables, the TOML file): the result is a valid config
whose fields have their declared types, or a one-line :class:`ConfigError` naming the field
(or, for a file that is not TOML at all, the file). Never another exception: the connector
turns any other one into "cannot start (TypeError ...)" and the CLI into a traceback.

Then the connector: a bad TOML value turns it off in its constructor with one line naming
the setting, and nothing raises into the engine.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3kv.config import S3KVConfig
from s3kv.errors import ConfigError

FIELDS = {f.name: f for f in dataclasses.fields(S3KVConfig)}
NAMES = sorted(FIELDS)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))

#: Strings that once slipped through or crashed somewhere: numbers Python parses that a
#: setting must not take, overflowing digits, junk units, non-ASCII digits, URL near-misses.
TRICKY_TEXT = [
    "", " ", "0", "-0", "-1", "1.5", "nan", "NaN", "inf", "-inf", "1e400", "9" * 400,
    "9" * 5000, "0x10", "1_000", "\u0661\u0662", "\u00b2", "true", "yes", "2w", "512MiB",
    "99999999999TiB", "7 days", "http://", "ftp://x", "http://h:99999", "http://u:p@h",
    "file://rel", "file:///abs", "https://minio:9000/p", "us-east-1", "a//b", "a\x00b",
    "line\nbreak", "\udcff", "\x7f", "x" * 700, "Bad Bucket", "kv", "0.0.0.0:9400",
]  # fmt: skip

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63), 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
    st.text(max_size=40),
    st.text(st.characters(min_codepoint=0, max_codepoint=0x1F), max_size=5),
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=3),
    st.sampled_from(TRICKY_TEXT),
    st.binary(max_size=20),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=5), SCALARS, max_size=2),
    st.just(datetime.date(1979, 5, 27)),
    st.just(object()),
)
ENV_TEXT = st.one_of(
    st.sampled_from(TRICKY_TEXT),
    st.text(max_size=40),
    st.text(st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), min_size=1, max_size=3),
    st.integers().map(str),
    st.floats().map(repr),
)

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (float,),
    "bool": (bool,),
    "str": (str,),
    "str | None": (str, type(None)),
    "int | Literal['auto']": (int, str),
}


def assert_well_typed(cfg: S3KVConfig) -> None:
    """Every field of a config that loaded has its declared type (no bool for an int, no
    NaN or infinity, no float for an integer)."""
    for name, f in FIELDS.items():
        value = getattr(cfg, name)
        kind = f.metadata.get("kind")
        if kind == "size":
            expected: tuple[type, ...] = (int,)
        elif kind == "duration":
            expected = (float,)
        else:
            expected = _TYPES.get(str(f.type), (str,))
        assert type(value) in expected, (name, value)
        if str(f.type) == "int | Literal['auto']" and isinstance(value, str):
            assert value == "auto", (name, value)
        if isinstance(value, float):
            assert math.isfinite(value), (name, value)


def assert_names(exc: ConfigError, *names: str) -> None:
    message = str(exc)
    assert any(name in message for name in names), (names, message)
    assert "\n" not in message, message
    assert "\r" not in message, message
    assert len(message) < 600, message


# ----------------------------------------------------------------------------------------
# Every entry point
# ----------------------------------------------------------------------------------------


@FUZZ
@given(name=st.sampled_from(NAMES), value=VALUES)
def test_constructor_and_replace(name: str, value: Any) -> None:
    def construct() -> S3KVConfig:
        return S3KVConfig(**{name: value})

    def replace() -> S3KVConfig:
        return S3KVConfig().replace(**{name: value})

    for build in (construct, replace):
        try:
            cfg = build()
        except ConfigError as exc:
            assert_names(exc, name)
        else:
            assert_well_typed(cfg)


@FUZZ
@given(name=st.sampled_from(NAMES), value=VALUES)
def test_overrides(name: str, value: Any) -> None:
    try:
        cfg = S3KVConfig.load(environ={}, **{name: value})
    except ConfigError as exc:
        assert_names(exc, name)
    else:
        assert_well_typed(cfg)


@FUZZ
@given(name=st.sampled_from(NAMES), text=ENV_TEXT)
def test_environment(name: str, text: str) -> None:
    env_name = S3KVConfig.env_name(name)
    try:
        cfg = S3KVConfig.load(environ={env_name: text})
    except ConfigError as exc:
        assert_names(exc, name)
    else:
        assert_well_typed(cfg)


def toml_value(value: Any) -> str:
    """``value`` written as a TOML value (what a user's file could hold)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
        )
    if isinstance(value, str):
        return json.dumps(value)  # NOTE: a lone surrogate is an escape TOML refuses
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, datetime.date):
        return value.isoformat()
    return json.dumps(repr(value))  # None, bytes, objects: a string TOML can hold


@FUZZ
@given(name=st.sampled_from(NAMES), value=VALUES, table=st.booleans())
def test_toml_file(
    tmp_path_factory: pytest.TempPathFactory, name: str, value: Any, table: bool
) -> None:
    path = tmp_path_factory.mktemp("toml") / "s3kv.toml"
    path.write_text(("[s3kv]\n" if table else "") + f"{name} = {toml_value(value)}\n")
    try:
        cfg = S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
    except ConfigError as exc:
        assert_names(exc, name, str(path))
    else:
        assert_well_typed(cfg)


@FUZZ
@given(content=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_any_file_content(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    path = tmp_path_factory.mktemp("bin") / "s3kv.toml"
    path.write_bytes(content)
    try:
        cfg = S3KVConfig.load(environ={"TLLM_S3KV_CONFIG": str(path)})
    except ConfigError as exc:
        assert_names(exc, str(path))
    else:
        assert_well_typed(cfg)


# ----------------------------------------------------------------------------------------
# Through the connector: a bad setting turns it off, in the constructor, with one line
# ----------------------------------------------------------------------------------------


def llm_args() -> SimpleNamespace:
    kv = SimpleNamespace(tokens_per_block=4, enable_block_reuse=True, enable_partial_reuse=False,
                         host_cache_size=0, dtype="auto")  # fmt: skip
    return SimpleNamespace(
        model="test/tiny", revision=None, dtype="bfloat16", tensor_parallel_size=1,
        pipeline_parallel_size=1, context_parallel_size=1, max_beam_width=1,
        enable_attention_dp=False, kv_cache_config=kv,
        scheduler_config=SimpleNamespace(capacity_scheduler_policy="GUARANTEED_NO_EVICT"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("line", "setting"),
    [
        ("staging_bytes = inf", "staging_bytes"),  # raised OverflowError before issue 12
        ("prefix = 5", "prefix"),  # raised TypeError before issue 12
        ("read_timeout = 0", "read_timeout"),  # failed at the first request (urllib3)
        ("io_threads = true", "io_threads"),
        ('endpoint_url = "minio:9000"', "endpoint_url"),
        ('bucket = "My_Bucket"', "bucket"),
    ],
)
def test_a_bad_toml_value_turns_the_connector_off_naming_the_setting(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    line: str,
    setting: str,
) -> None:
    import torch

    from s3kv.connector.trtllm import S3KVConnectorScheduler, S3KVConnectorWorker

    path = tmp_path / "s3kv.toml"
    path.write_text(f"[s3kv]\n{line}\n")
    monkeypatch.setenv("TLLM_S3KV_CONFIG", str(path))
    caplog.set_level(logging.ERROR)

    # The engine constructs both sides: neither may raise.
    scheduler = S3KVConnectorScheduler(llm_args())
    worker = S3KVConnectorWorker(llm_args())
    assert scheduler.core is None
    assert scheduler.off_reason.startswith(f"{setting}: "), scheduler.off_reason
    assert worker.off_reason.startswith(f"{setting}: "), worker.off_reason
    # One line, naming the setting and the file it came from.
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert setting in errors[0], errors
    assert str(path) in errors[0], errors
    assert "\n" not in errors[0], errors

    # The rest of the engine's calls answer "nothing cached, nothing to do".
    worker.register_kv_caches(torch.zeros(8, 2, 2, 64, dtype=torch.bfloat16))
    assert worker.core is None
    request = SimpleNamespace(request_id=1, prompt_len=17, get_tokens=lambda beam: [1] * 17)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert worker.get_finished([5], []) == ([5], [])
