"""Where codec processes run (``codec_cpus``): the choice, the setting, the one-line errors."""

from __future__ import annotations

import os

import pytest

from s3kv.config import S3KVConfig, parse_cpu_list
from s3kv.errors import ConfigError
from s3kv.offload import affinity, choose_cpus
from s3kv.offload.affinity import crowds_engine, format_cpus

HOST = frozenset(range(16))


def test_auto_keeps_a_wide_engine_mask() -> None:
    placement = choose_cpus("auto", 4, engine=frozenset(range(8)), available=HOST)
    assert placement.cpus is None
    assert not crowds_engine(placement, 4)


def test_auto_moves_the_codec_off_an_engine_pinned_to_few_cpus() -> None:
    engine = frozenset({2, 3})
    placement = choose_cpus("auto", 4, engine=engine, available=HOST)
    assert placement.cpus == HOST - engine
    assert "pinned to CPUs 2-3" in placement.reason
    assert not crowds_engine(placement, 4)


def test_auto_on_a_host_with_no_other_cpu_inherits_and_is_flagged() -> None:
    engine = frozenset({0, 1})
    placement = choose_cpus("auto", 4, engine=engine, available=engine)
    assert placement.cpus is None
    assert crowds_engine(placement, 4)


def test_inherit_keeps_the_mask_even_when_it_crowds_the_engine() -> None:
    engine = frozenset({5})
    placement = choose_cpus("inherit", 2, engine=engine, available=HOST)
    assert placement.cpus is None
    assert crowds_engine(placement, 2)


def test_an_explicit_list_is_taken_as_is() -> None:
    placement = choose_cpus("8-11, 14", 4, engine=frozenset({0}), available=HOST)
    assert placement.cpus == frozenset({8, 9, 10, 11, 14})


def test_cpus_this_host_lacks_are_a_bad_setting_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        choose_cpus("12-20", 2, engine=frozenset({0}), available=HOST)
    message = str(caught.value)
    assert message.startswith("codec_cpus: CPUs 16-20 are not available to this process")
    assert "available: 0-15" in message
    assert "\n" not in message


@pytest.mark.parametrize("bad", ["8-", "x", "3-1", "1,,2", "-4", "auto,1", "99999"])
def test_a_malformed_list_fails_at_the_setting(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        S3KVConfig(codec_cpus=bad)
    assert str(caught.value).startswith("codec_cpus: ")
    assert "\n" not in str(caught.value)


def test_the_setting_comes_from_the_environment() -> None:
    config = S3KVConfig.load(environ={"TLLM_S3KV_CODEC_CPUS": "4-7"})
    assert parse_cpu_list(config.codec_cpus) == frozenset(range(4, 8))
    assert S3KVConfig().codec_cpus == "auto"


@pytest.mark.parametrize(
    ("cpus", "text"),
    [({0}, "0"), ({0, 1, 2, 3}, "0-3"), ({0, 2, 3, 7, 9, 10}, "0,2-3,7,9-10"), (set(), "")],
)
def test_cpu_lists_print_as_the_setting_takes_them(cpus: set[int], text: str) -> None:
    assert format_cpus(frozenset(cpus)) == text
    if text:
        assert parse_cpu_list(text) == frozenset(cpus)


def test_the_cpus_a_process_may_be_given_lie_within_the_online_ones() -> None:
    allowed = affinity.allowed_cpus()
    assert allowed
    assert allowed <= affinity.online_cpus()
    assert frozenset(os.sched_getaffinity(0)) <= allowed
