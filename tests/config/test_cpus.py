"""parallel.cpus: a node's CPU set, in taskset syntax, validated by the config loader."""
from __future__ import annotations

import pytest

from pdkv.config import ConfigError, config_from_dict
from pdkv.cpus import parse_cpu_list


def test_cpu_lists_parse_like_taskset():
    assert parse_cpu_list("") == ()
    assert parse_cpu_list("0") == (0,)
    assert parse_cpu_list("0-2,5, 7-8") == (0, 1, 2, 5, 7, 8)
    for bad in ("a", "3-1", "1-", "-2", "0;1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_config_field_is_validated_with_its_name():
    assert config_from_dict({"parallel": {"cpus": "0-1"}}).parallel.cpus == "0-1"
    with pytest.raises(ConfigError, match=r"parallel.cpus must be a CPU list"):
        config_from_dict({"parallel": {"cpus": "1-0"}})
