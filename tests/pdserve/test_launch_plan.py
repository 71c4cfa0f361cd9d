"""A launch plan's children: names, ports, thread split and command lines (nothing is started)."""

from __future__ import annotations

import sys

import pytest

from pdserve.launch_plan import LaunchPlan, default_command, threads_per_node


def test_threads_are_split_between_nodes():
    assert threads_per_node(3, cpu_count=16) == 5
    assert threads_per_node(2, cpu_count=2) == 1
    assert threads_per_node(4, cpu_count=2) == 1  # never zero


def test_plan_rejects_an_empty_disaggregated_cluster():
    with pytest.raises(ValueError, match="num_decode >= 1"):
        LaunchPlan(model="m", num_decode=0)
    LaunchPlan(model="m", num_prefill=0, num_decode=0, colocated=True)
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        LaunchPlan(model="m", num_threads=0)


def test_child_specs_and_default_commands():
    plan = LaunchPlan(
        model="m",
        host="0.0.0.0",
        port=9000,
        num_prefill=2,
        num_decode=1,
        node_args=("--kv-cache-gib", "0.5"),
    )
    specs = plan.child_specs("redis://r:1/0")
    assert [(s.name, s.role) for s in specs] == [
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
        ("gateway", "gateway"),
    ]
    node_ports = [s.port for s in specs[:3]]
    assert len(set(node_ports)) == 3 and all(s.host == "127.0.0.1" for s in specs[:3])
    assert specs[0].num_threads == threads_per_node(3)
    assert default_command(specs[2]) == [
        sys.executable,
        "-m",
        "pdserve.cli",
        "decode",
        "--model",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(node_ports[2]),
        "--redis-url",
        "redis://r:1/0",
        "--node-id",
        "decode-0",
        "--num-threads",
        str(threads_per_node(3)),
        "--kv-cache-gib",
        "0.5",
    ]
    assert default_command(specs[3]) == [
        sys.executable,
        "-m",
        "pdserve.cli",
        "gateway",
        "--model",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--redis-url",
        "redis://r:1/0",
    ]


def test_colocated_plan_runs_one_node():
    plan = LaunchPlan(model="m", colocated=True)
    specs = plan.child_specs("redis://r:1/0")
    assert [(s.name, s.role) for s in specs] == [("colocated-0", "colocated"), ("gateway", "gateway")]
    assert specs[0].num_threads == threads_per_node(1)


def test_a_node_spec_appends_role_flags_then_its_own():
    plan = LaunchPlan(model="m", node_args=("--a", "1"), prefill_args=("--b", "2"), num_threads=3)
    prefill = plan.node_spec("prefill", "prefill-late", 1234, "redis://r:1/0", ("--c", "3"))
    assert (prefill.name, prefill.port, prefill.num_threads) == ("prefill-late", 1234, 3)
    assert prefill.extra_args == ("--a", "1", "--b", "2", "--c", "3")
    assert plan.node_spec("decode", "d", 1234, "redis://r:1/0").extra_args == ("--a", "1")
    with pytest.raises(ValueError, match="not a node role"):
        plan.node_spec("gateway", "g", 1234, "redis://r:1/0")
