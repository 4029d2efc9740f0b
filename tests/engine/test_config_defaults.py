"""A server's engine takes shorter steps than an offline one (engine/config.py SERVER_DEFAULTS), and a flag or an
option still overrides either."""

from __future__ import annotations

import argparse

import pytest

from tokenfleet.cli import build_parser
from tokenfleet.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args


@pytest.mark.parametrize("command", ["serve", "replica"])
def test_servers_default_to_a_1024_token_step(command):
    args = build_parser(only=command).parse_args([command, "--model", "m"])
    assert engine_config_from_args(args).max_num_batched_tokens == 1024
    args = build_parser(only=command).parse_args([command, "--model", "m", "--max-num-batched-tokens", "4096"])
    assert engine_config_from_args(args).max_num_batched_tokens == 4096


def test_offline_engines_keep_a_2048_token_step():
    assert EngineConfig.from_options("m").max_num_batched_tokens == 2048
    assert EngineConfig.from_options("m", max_num_batched_tokens=512).max_num_batched_tokens == 512


def test_a_default_given_for_a_switch_is_taken_too():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, defaults={"enable_prefix_caching": False})
    assert parser.parse_args(["--model", "m"]).enable_prefix_caching is False
    assert parser.parse_args(["--model", "m", "--enable-prefix-caching"]).enable_prefix_caching is True
