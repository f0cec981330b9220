"""docker-compose.yml is structurally sound (no Docker engine runs here, so no `compose config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
SERVICES = {"nats", "postgres", "engine"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


def _depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on", {})
    # Compose accepts a list of names or a mapping name -> {condition: ...}.
    return {name: {} for name in deps} if isinstance(deps, list) else deps


def test_defines_nats_postgres_and_the_engine(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == SERVICES


def test_every_service_has_an_image_or_a_build(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "image" in service or "build" in service, name
    assert services["nats"]["image"].startswith("nats:2.10")
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["engine"]["build"] == "."
    assert (COMPOSE_FILE.parent / "Dockerfile").is_file()


def test_nats_runs_jetstream_with_a_store_dir(services: dict[str, dict[str, Any]]) -> None:
    command = services["nats"]["command"]
    args = command.split() if isinstance(command, str) else command
    assert "-js" in args
    assert "-sd" in args


def test_every_dependency_is_a_defined_service(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency in _depends_on(service):
            assert dependency in services, f"{name} depends on undefined {dependency}"
            assert dependency != name


def test_engine_waits_for_a_healthy_postgres(services: dict[str, dict[str, Any]]) -> None:
    deps = _depends_on(services["engine"])
    assert set(deps) == {"nats", "postgres"}
    assert deps["postgres"]["condition"] == "service_healthy"
    assert "healthcheck" in services["postgres"]
    test = services["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in (test if isinstance(test, str) else " ".join(test))
    # Only services with a healthcheck can be waited on as healthy.
    for dependency, spec in deps.items():
        if spec.get("condition") == "service_healthy":
            assert "healthcheck" in services[dependency], dependency


def test_published_ports_bind_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            if isinstance(port, dict):  # long syntax
                assert port.get("host_ip") == "127.0.0.1", name
            else:
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on all hosts"


def test_engine_is_pointed_at_both_servers(services: dict[str, dict[str, Any]]) -> None:
    env = services["engine"]["environment"]
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    assert env["TRELLIS_NATS_URL"] == "nats://nats:4222"
    assert env["TRELLIS_DATABASE_URL"] == "postgresql://postgres@postgres:5432/trellis"
    command = services["engine"]["command"]
    assert (command.split() if isinstance(command, str) else command) == ["trellis", "up"]


def test_postgres_trusts_local_connections_and_creates_the_database(
    services: dict[str, dict[str, Any]],
) -> None:
    env = services["postgres"]["environment"]
    assert env["POSTGRES_HOST_AUTH_METHOD"] == "trust"
    assert env["POSTGRES_DB"] == "trellis"


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume["source"]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} uses undeclared volume {source}"
