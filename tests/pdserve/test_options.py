"""Each option is defined once (pdserve/options.py): flags, environment variables and the flags
`pdserve up` hands its children all come from the same fields."""

from __future__ import annotations

import argparse

import pytest

from gateway.settings import ApiKeyOptions, GatewaySettings, RouterOptions, RoutingPolicy
from pdserve.cli import build_parser, run_cluster
from pdserve.engine.config import SchedulerConfig
from pdserve.launch_plan import default_command
from pdserve.options import (
    EngineOptions,
    KvTransferOptions,
    NodeSettings,
    UpSettings,
    add_flags,
    settings_from_args,
    to_flags,
)


def parse(settings_cls, argv: list[str]):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, settings_cls)
    return settings_from_args(settings_cls, parser.parse_args(argv), parser)


def test_flag_defaults_are_the_engines_own():
    settings = parse(NodeSettings, [])
    assert settings.max_num_seqs == SchedulerConfig.max_num_seqs == 64
    assert settings.engine_config() == EngineOptions().engine_config()
    assert settings.engine_config().cache.kv_cache_memory_bytes == 1 << 30


def test_flags_reach_the_engine_config():
    argv = ["--max-num-seqs", "8", "--kv-cache-gib", "0.5", "--no-prefix-caching", "--dtype", "bfloat16"]
    argv += ["--kv-cache-dtype", "float16"]
    config = parse(NodeSettings, argv).engine_config()
    assert config.cache.dtype == "float16"
    assert config.scheduler.max_num_seqs == 8
    assert config.cache.kv_cache_memory_bytes == 1 << 29
    assert config.cache.enable_prefix_caching is False
    assert config.dtype == "bfloat16"


def test_environment_variables_fill_what_flags_do_not_give(monkeypatch):
    monkeypatch.setenv("PDSERVE_NODE_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("PDSERVE_NODE_KV_TRANSPORT", "grpc")
    settings = parse(NodeSettings, ["--kv-transport", "shm"])
    assert settings.max_num_seqs == 12
    assert settings.kv_transport == "shm"  # the flag wins over the environment


def test_a_bad_value_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(NodeSettings, ["--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    assert "--max-num-seqs: Input should be greater than or equal to 1" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parse(NodeSettings, ["--kv-transport", "carrier-pigeon"])


def test_up_hands_its_nodes_and_gateway_the_same_values_through_the_same_fields():
    up = parse(UpSettings, ["--max-num-seqs", "8", "--no-prefix-caching", "--router-policy", "least_load"])
    node_flags = to_flags(up, EngineOptions, KvTransferOptions, exclude={"model"})
    node = parse(NodeSettings, ["--redis-url", "redis://r:1/0", *node_flags])
    assert {name: getattr(node, name) for name in EngineOptions.model_fields} == {
        name: getattr(up, name) for name in EngineOptions.model_fields
    }
    assert node.kv_transport == up.kv_transport and node.kv_lease_s == up.kv_lease_s
    gateway = parse(GatewaySettings, to_flags(up, RouterOptions))
    assert gateway.router_policy is RoutingPolicy.LEAST_LOAD
    assert gateway.router_load_factor == up.router_load_factor


def test_every_field_of_every_command_has_a_flag_and_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for command, settings_cls in [("prefill", NodeSettings), ("gateway", GatewaySettings), ("up", UpSettings)]:
        actions = {action.dest: action for action in commands[command]._actions}
        for name, field in settings_cls.model_fields.items():
            assert name in actions, f"pdserve {command} has no flag for {name}"
            assert field.description and field.description in actions[name].help


def test_a_list_option_is_a_repeated_flag_and_a_comma_separated_variable(monkeypatch):
    assert parse(GatewaySettings, ["--api-key", "sk-a", "--api-key", "sk-b,sk-c"]).api_key == ["sk-a", "sk-b", "sk-c"]
    monkeypatch.setenv("PDSERVE_GATEWAY_API_KEY", "sk-env-a,sk-env-b")
    assert parse(GatewaySettings, []).api_key == ["sk-env-a", "sk-env-b"]
    assert parse(GatewaySettings, ["--api-key", "sk-flag"]).api_key == ["sk-flag"]  # the flag wins
    up = parse(UpSettings, ["--api-key", "sk-a", "--api-key", "sk-b", "--metrics-require-api-key"])
    assert to_flags(up, ApiKeyOptions) == ["--api-key", "sk-a", "--api-key", "sk-b", "--metrics-require-api-key"]


def test_up_hands_its_gateway_the_keys_by_environment_not_argv(monkeypatch):
    plans = []
    monkeypatch.setattr("pdserve.launcher.run_up", lambda plan: plans.append(plan) or 0)
    run_cluster(parse(UpSettings, ["--api-key", "sk-a", "--api-key", "sk-b", "--metrics-require-api-key"]))
    (gateway,) = [spec for spec in plans[0].child_specs("redis://r:1/0") if spec.role == "gateway"]
    assert dict(gateway.env)["PDSERVE_GATEWAY_API_KEY"] == "sk-a,sk-b"
    assert "--metrics-require-api-key" in gateway.extra_args
    assert not any("sk-" in arg for arg in default_command(gateway))
    monkeypatch.setenv("PDSERVE_GATEWAY_API_KEY", dict(gateway.env)["PDSERVE_GATEWAY_API_KEY"])
    assert parse(GatewaySettings, list(gateway.extra_args)).api_key == ["sk-a", "sk-b"]


def test_up_hands_the_grpc_tls_paths_to_every_node_and_the_gateway(monkeypatch):
    plans = []
    monkeypatch.setattr("pdserve.launcher.run_up", lambda plan: plans.append(plan) or 0)
    tls_flags = ["--grpc-tls-cert", "/c.pem", "--grpc-tls-key", "/k.pem", "--grpc-tls-ca", "/ca.pem"]
    run_cluster(parse(UpSettings, tls_flags))
    specs = plans[0].child_specs("redis://r:1/0")
    assert {spec.role for spec in specs} == {"gateway", "prefill", "decode"}
    for spec in specs:
        settings = parse(GatewaySettings if spec.role == "gateway" else NodeSettings, list(spec.extra_args))
        assert (settings.grpc_tls_cert, settings.grpc_tls_key, settings.grpc_tls_ca) == ("/c.pem", "/k.pem", "/ca.pem")


def test_up_hands_its_stream_interval_to_every_node(monkeypatch):
    plans = []
    monkeypatch.setattr("pdserve.launcher.run_up", lambda plan: plans.append(plan) or 0)
    run_cluster(parse(UpSettings, ["--stream-interval", "4"]))
    node_specs = [spec for spec in plans[0].child_specs("redis://r:1/0") if spec.role != "gateway"]
    assert {spec.role for spec in node_specs} == {"prefill", "decode"}
    for spec in node_specs:
        assert parse(NodeSettings, list(spec.extra_args)).stream_interval == 4


def test_up_hands_its_token_stream_port_to_every_node_and_refuses_one_port_for_many(monkeypatch, capsys):
    plans = []
    monkeypatch.setattr("pdserve.launcher.run_up", lambda plan: plans.append(plan) or 0)
    run_cluster(parse(UpSettings, ["--token-stream-port", "-1"]))
    (decode,) = [spec for spec in plans[0].child_specs("redis://r:1/0") if spec.role == "decode"]
    assert parse(NodeSettings, list(decode.extra_args)).token_stream_port == -1
    assert parse(NodeSettings, []).token_stream_port == 0  # on, on a free port, by default
    with pytest.raises(SystemExit):
        parse(UpSettings, ["--decode", "2", "--token-stream-port", "50052"])
    assert "give 0 (a free port each) or -1" in capsys.readouterr().err
