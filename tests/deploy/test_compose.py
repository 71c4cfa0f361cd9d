"""docker-compose.yml, docker-compose.gpu.yml and the files they name, checked without Docker: each
pdserve service's command and environment form a valid `pdserve` command line, nodes scale
(no fixed names or host ports), and every setting named exists as an option."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from gateway.settings import GatewaySettings
from pdserve.cli import build_parser
from pdserve.options import NodeSettings, settings_from_args
from tests.deploy.compose_files import REPO_ROOT, REQUIRED_PLACEHOLDER, load_compose, required_variables

NODE_SERVICES = ("prefill", "decode")
PDSERVE_SERVICES = ("gateway", *NODE_SERVICES)
ENV_PREFIX_TO_SETTINGS = {"PDSERVE_NODE_": NodeSettings, "PDSERVE_GATEWAY_": GatewaySettings}


@pytest.fixture(scope="module")
def services() -> dict:
    return load_compose()["services"]


def test_the_stack_has_redis_the_gateway_both_phases_and_a_monitoring_profile(services):
    assert set(services) == {"redis", "gateway", "prefill", "decode", "prometheus", "grafana"}
    assert services["gateway"]["ports"] == ["8000:8000"]
    assert all(services[name]["profiles"] == ["monitoring"] for name in ("prometheus", "grafana"))
    assert all("restart" in services[name] for name in services)


@pytest.mark.parametrize("name", NODE_SERVICES)
def test_a_node_service_scales(services, name):
    service = services[name]
    # Fixed names, host ports or hostnames would make a second replica collide (or share a KV host id).
    assert not {"container_name", "ports", "hostname", "network_mode", "ipc"} & set(service)
    assert service["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert service["healthcheck"]["test"][:2] == ["CMD", "python"]


def test_the_gateway_waits_for_redis_and_healthy_nodes_and_checks_health(services):
    gateway = services["gateway"]
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in ("redis", *NODE_SERVICES)}
    assert "/health" in " ".join(gateway["healthcheck"]["test"])


@pytest.mark.parametrize("name", PDSERVE_SERVICES)
def test_command_and_environment_form_a_valid_pdserve_command_line(services, name, monkeypatch):
    service = services[name]
    for variable in [v for v in os.environ if v.startswith("PDSERVE_")]:
        monkeypatch.delenv(variable)
    for variable, value in service["environment"].items():
        monkeypatch.setenv(variable, str(value))
    parser = build_parser()
    args = parser.parse_args(service["command"])  # the image's ENTRYPOINT is ["pdserve"]
    assert args.command == name and args.log_level == "INFO"
    settings = settings_from_args(GatewaySettings if name == "gateway" else NodeSettings, args, parser)
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.host == "0.0.0.0"
    assert settings.secret_value() == REQUIRED_PLACEHOLDER
    if name != "gateway":
        assert (settings.port, settings.advertise_host, settings.kv_transport) == (50051, "auto", "grpc")
        assert settings.model == "smollm2-135m"
        assert settings.metrics_port == 9100  # where Prometheus looks for every replica


def test_every_pdserve_variable_in_compose_and_the_images_is_an_option():
    sources = ["docker-compose.yml", "docker-compose.gpu.yml", "deploy/node.Dockerfile", "deploy/gateway.Dockerfile"]
    names = {
        n for path in sources for n in re.findall(r"\bPDSERVE_(?:NODE|GATEWAY)_\w+", (REPO_ROOT / path).read_text())
    }
    assert {"PDSERVE_NODE_MODEL", "PDSERVE_GATEWAY_ROUTER_POLICY"} <= names
    for name in names:
        prefix = next(p for p in ENV_PREFIX_TO_SETTINGS if name.startswith(p))
        assert name.removeprefix(prefix).lower() in ENV_PREFIX_TO_SETTINGS[prefix].model_fields, name


def test_every_compose_variable_is_documented_in_env_example():
    documented = set(re.findall(r"^(\w+)=", (REPO_ROOT / ".env.example").read_text(), re.MULTILINE))
    used = set()
    for path in ("docker-compose.yml", "docker-compose.gpu.yml"):
        used |= set(re.findall(r"\$\{(\w+)", (REPO_ROOT / path).read_text()))
    assert used <= documented, used - documented
    assert required_variables() == {"PDSERVE_CLUSTER_SECRET"}


def test_the_gpu_override_reserves_an_nvidia_device_per_node():
    services = load_compose("docker-compose.gpu.yml")["services"]
    assert set(services) == set(NODE_SERVICES)
    for service in services.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert service["environment"]["PDSERVE_NODE_DEVICE"] == "cuda"


def test_prometheus_finds_every_replica_of_both_phases(services):
    config = yaml.safe_load((REPO_ROOT / "deploy/prometheus.yml").read_text())
    job_to_config = {job["job_name"]: job for job in config["scrape_configs"]}
    metrics_port = int(services["decode"]["environment"]["PDSERVE_NODE_METRICS_PORT"])
    for role in NODE_SERVICES:
        (discovery,) = job_to_config[role]["dns_sd_configs"]
        assert discovery["names"] == [role] and discovery["port"] == metrics_port
    assert job_to_config["gateway"]["static_configs"] == [{"targets": ["gateway:8000"]}]


def test_the_dashboard_covers_latency_throughput_cache_transfer_and_routing():
    dashboard = json.loads((REPO_ROOT / "deploy/grafana/dashboards/pdserve.json").read_text())
    expressions = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    for metric in (
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_bucket",
        "pdserve:kv_cache_usage_perc",
        "pdserve:prefix_cache_hits_total",
        "pdserve:kv_transfer_received_bytes_total",
        "pdserve_gateway_routed_requests_total",
    ):
        assert metric in expressions


def test_the_gateway_image_installs_what_the_gateway_imports():
    """The distributions `import gateway.server` loads that the project depends on are all in the gateway
    image's requirements (grpcio-tools, loaded by grpc when present, is not needed)."""
    code = (
        "import sys, importlib.metadata as md, gateway.server, gateway.app, pdserve.cli\n"
        "dists = md.packages_distributions()\n"
        "print(' '.join({d for m in list(sys.modules) for d in dists.get(m.split('.')[0], [])}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    project = {_name(r) for r in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    lines = (REPO_ROOT / "deploy/gateway-requirements.txt").read_text().splitlines()
    required = {_name(line) for line in lines if line and not line.startswith("#")}
    needed = ({_name(d) for d in loaded.stdout.split()} & project) - {"grpcio-tools"}
    assert needed <= required, needed - required
    assert "torch" not in required and required <= project


def _name(requirement: str) -> str:
    return re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")
