"""Configuration from the environment: defaults, every variable, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from trellis.adapters.bootstrap import fabric_from_settings, fabric_state_path
from trellis.adapters.entrypoints import cli
from trellis.adapters.fabric.redfish.driver import RedfishFabric
from trellis.adapters.fabric.sim import ScriptedFault, SimulatedFabric
from trellis.adapters.nats.jetstream import StreamLimits
from trellis.adapters.settings import Settings, SettingsError, redacted


def test_an_empty_environment_means_the_defaults() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.fabric == "sim" and settings.saga_deadline == 10.0
    assert settings.fabric_script == []


def test_every_variable_is_read() -> None:
    settings = Settings.from_env(
        {
            "TRELLIS_NATS_URL": "nats://n:4222",
            "TRELLIS_DATABASE_URL": "postgresql://p/db",
            "TRELLIS_DATABASE_OWNER_URL": "postgresql://owner@p/db",
            "TRELLIS_DATA_DIR": "/var/trellis",
            "TRELLIS_DOMAINS": "hall-1, hall-2",
            "TRELLIS_SUBJECT_PREFIX": "t1",
            "TRELLIS_DB_SCHEMA": "s1",
            "TRELLIS_FABRIC": "sim",
            "TRELLIS_FABRIC_STATE": "/srv/fabric.json",
            "TRELLIS_SAGA_DEADLINE": "2.5",
            "TRELLIS_MAX_DOMAINS_PER_ENGINE": "12",
            "TRELLIS_READ_WAIT": "0.5",
            "TRELLIS_FABRIC_SEED": "7",
            "TRELLIS_FABRIC_LATENCY_MS": "20",
            "TRELLIS_FABRIC_FAILURE_RATE": "0.1",
            "TRELLIS_FABRIC_HANG_RATE": "0",
            "TRELLIS_FABRIC_SCRIPT": "hang:bind,fail:create_circuit:ocs-1",
            "TRELLIS_EVENTS_MAX_BYTES": "1048576",
            "TRELLIS_EVENTS_MAX_AGE": "0",
            "TRELLIS_JS_REPLICAS": "3",
            "TRELLIS_KV_MARKER_TTL": "3600",
            "TRELLIS_METRICS_PORT": "9464",
            "TRELLIS_METRICS_HOST": "0.0.0.0",
            "TRELLIS_EVENT_LOOP": "asyncio",
            "TRELLIS_FOLLOW_GATHER_MS": "10",
        }
    )
    assert settings == Settings(
        nats_url="nats://n:4222",
        database_url="postgresql://p/db",
        database_owner_url="postgresql://owner@p/db",
        data_dir=Path("/var/trellis"),
        domains=["hall-1", "hall-2"],
        subject_prefix="t1",
        db_schema="s1",
        fabric="sim",
        fabric_state=Path("/srv/fabric.json"),
        saga_deadline=2.5,
        max_domains_per_engine=12,
        read_wait=0.5,
        fabric_seed=7,
        fabric_latency_ms=20.0,
        fabric_failure_rate=0.1,
        fabric_hang_rate=0.0,
        fabric_script=[
            ScriptedFault(kind="hang", op="bind"),
            ScriptedFault(kind="fail", op="create_circuit", component="ocs-1"),
        ],
        stream_limits=StreamLimits(max_bytes=1048576, max_age_s=0.0, replicas=3, marker_ttl_s=3600),
        metrics_port=9464,
        metrics_host="0.0.0.0",
        event_loop="asyncio",
        follow_gather_s=0.01,
    )


def test_metrics_are_off_unless_a_port_is_given_and_0_takes_a_free_one() -> None:
    assert Settings.from_env({}).metrics_port is None
    assert Settings.from_env({}).metrics_host == "127.0.0.1"
    assert Settings.from_env({"TRELLIS_METRICS_PORT": "0"}).metrics_port == 0


def test_one_port_pinned_for_two_embedded_servers_is_refused() -> None:
    env = {"TRELLIS_NATS_PORT": "4300", "TRELLIS_PG_PORT": "4300"}
    with pytest.raises(SettingsError, match="TRELLIS_NATS_PORT and TRELLIS_PG_PORT are both 4300"):
        Settings.from_env(env)
    pinned = Settings.from_env({**env, "TRELLIS_PG_PORT": "4301"})
    assert (pinned.nats_port, pinned.pg_port) == (4300, 4301)


@pytest.mark.parametrize(
    ("variable", "value", "complaint"),
    [
        ("TRELLIS_DOMAINS", "hall 1", "TRELLIS_DOMAINS holds invalid ids: 'hall 1'"),
        # Empty between commas: ",,," served every domain, as if it were unset.
        ("TRELLIS_DOMAINS", ",,,", "TRELLIS_DOMAINS holds invalid ids: '', '', '', ''"),
        ("TRELLIS_DOMAINS", "a,,b", "TRELLIS_DOMAINS holds invalid ids: ''"),
        (
            "TRELLIS_FABRIC",
            "h3",
            "TRELLIS_FABRIC='h3' names no fabric driver; valid: sim, redfish",
        ),
        ("TRELLIS_FABRIC", "redfish", "TRELLIS_FABRIC=redfish needs TRELLIS_REDFISH_URL"),
        ("TRELLIS_REDFISH_URL", "fm:8000", "TRELLIS_REDFISH_URL: 'fm:8000' is no http://"),
        ("TRELLIS_REDFISH_URL", "https://root:pw@fm", "TRELLIS_REDFISH_URL: give the Redfish"),
        ("TRELLIS_REDFISH_EVENTS", "9000", "TRELLIS_REDFISH_EVENTS must be HOST:PORT"),
        (
            "TRELLIS_REDFISH_AUTH",
            "digest",
            "TRELLIS_REDFISH_AUTH='digest': valid are basic, session",
        ),
        ("TRELLIS_REDFISH_EVENTS", "h:port", "TRELLIS_REDFISH_EVENTS must be a TCP port"),
        ("TRELLIS_SAGA_DEADLINE", "0", "TRELLIS_SAGA_DEADLINE must be a number of seconds above 0"),
        ("TRELLIS_SAGA_DEADLINE", "soon", "TRELLIS_SAGA_DEADLINE must be a number of seconds"),
        ("TRELLIS_SAGA_DEADLINE", "inf", "TRELLIS_SAGA_DEADLINE must be a number of seconds"),
        ("TRELLIS_READ_WAIT", "-1", "TRELLIS_READ_WAIT must be a number of seconds, 0 or more"),
        ("TRELLIS_MAX_DOMAINS_PER_ENGINE", "-1", "TRELLIS_MAX_DOMAINS_PER_ENGINE must be 0 (no"),
        ("TRELLIS_MAX_DOMAINS_PER_ENGINE", "many", "TRELLIS_MAX_DOMAINS_PER_ENGINE must be an int"),
        ("TRELLIS_FABRIC_SEED", "1.5", "TRELLIS_FABRIC_SEED must be an integer; got '1.5'"),
        ("TRELLIS_FABRIC_LATENCY_MS", "-1", "TRELLIS_FABRIC_LATENCY_MS must be milliseconds"),
        ("TRELLIS_FABRIC_FAILURE_RATE", "1.5", "TRELLIS_FABRIC_FAILURE_RATE must be a probability"),
        ("TRELLIS_FABRIC_HANG_RATE", "nan", "TRELLIS_FABRIC_HANG_RATE must be a probability"),
        ("TRELLIS_FABRIC_SCRIPT", "fail:bnid", "TRELLIS_FABRIC_SCRIPT: fault 'fail:bnid': 'bnid'"),
        ("TRELLIS_EVENTS_MAX_BYTES", "1.5", "TRELLIS_EVENTS_MAX_BYTES must be an integer"),
        ("TRELLIS_EVENT_LOOP", "trio", "TRELLIS_EVENT_LOOP='trio': valid are uvloop, asyncio"),
        ("TRELLIS_FOLLOW_GATHER_MS", "-5", "TRELLIS_FOLLOW_GATHER_MS must be milliseconds, 0 to"),
        ("TRELLIS_FOLLOW_GATHER_MS", "soon", "TRELLIS_FOLLOW_GATHER_MS must be milliseconds"),
        (
            "TRELLIS_FOLLOW_GATHER_MS",
            "5000",
            "TRELLIS_FOLLOW_GATHER_MS must be milliseconds, 0 to 1000",
        ),
        ("TRELLIS_FOLLOW_GATHER_MS", "inf", "TRELLIS_FOLLOW_GATHER_MS must be milliseconds"),
        ("TRELLIS_FOLLOW_GATHER_MS", "nan", "TRELLIS_FOLLOW_GATHER_MS must be milliseconds"),
        ("TRELLIS_EVENTS_MAX_BYTES", "-1", "TRELLIS_EVENTS_MAX_BYTES must be 0 (no limit) to"),
        ("TRELLIS_EVENTS_MAX_BYTES", "9" * 23, "TRELLIS_EVENTS_MAX_BYTES must be 0 (no limit)"),
        ("TRELLIS_EVENTS_MAX_AGE", "-5", "TRELLIS_EVENTS_MAX_AGE must be seconds: 0 (no limit)"),
        # Past a Go duration: an OverflowError, exit 70; below a second JetStream refused it
        # and the message named TRELLIS_JS_REPLICAS.
        ("TRELLIS_EVENTS_MAX_AGE", "1e300", "TRELLIS_EVENTS_MAX_AGE must be seconds: 0 (no"),
        ("TRELLIS_EVENTS_MAX_AGE", "0.0001", "TRELLIS_EVENTS_MAX_AGE must be seconds: 0 (no"),
        # PostgreSQL's interval overflowed, and every append answered unavailable.
        ("TRELLIS_LEASE_TTL", "1e300", "TRELLIS_LEASE_TTL must be a number of seconds, 0.5 to"),
        ("TRELLIS_LEASE_TTL", "0.1", "TRELLIS_LEASE_TTL must be a number of seconds, 0.5 to"),
        # A URL that can never name a server was waited for without end.
        ("TRELLIS_DATABASE_URL", "garbage", "TRELLIS_DATABASE_URL is not a PostgreSQL URL"),
        ("TRELLIS_DATABASE_URL", "mysql://x@h/db", "TRELLIS_DATABASE_URL is not a PostgreSQL"),
        ("TRELLIS_DATABASE_URL", "postgres:/x", "TRELLIS_DATABASE_URL is not a PostgreSQL URL"),
        # Straight into the search_path: PostgreSQL's refusal was an internal error, exit 70.
        ("TRELLIS_DB_SCHEMA", "bad schema", "TRELLIS_DB_SCHEMA must be a schema name"),
        ("TRELLIS_DB_SCHEMA", "Tenant1", "TRELLIS_DB_SCHEMA must be a schema name"),
        # One token, which names the streams too: JetStream refused them, "a replicas problem".
        ("TRELLIS_SUBJECT_PREFIX", "my trellis", "TRELLIS_SUBJECT_PREFIX must be one subject"),
        ("TRELLIS_SUBJECT_PREFIX", "a.b", "TRELLIS_SUBJECT_PREFIX must be one subject token"),
        ("TRELLIS_SUBJECT_PREFIX", ">", "TRELLIS_SUBJECT_PREFIX must be one subject token"),
        ("TRELLIS_KV_MARKER_TTL", "-1", "TRELLIS_KV_MARKER_TTL must be whole seconds"),
        ("TRELLIS_KV_MARKER_TTL", "10000000000", "TRELLIS_KV_MARKER_TTL must be whole seconds"),
        ("TRELLIS_KV_MARKER_TTL", "1.5", "TRELLIS_KV_MARKER_TTL must be an integer"),
        ("TRELLIS_JS_REPLICAS", "0", "TRELLIS_JS_REPLICAS must be within 1..5"),
        ("TRELLIS_JS_REPLICAS", "7", "TRELLIS_JS_REPLICAS must be within 1..5"),
        ("TRELLIS_JS_REPLICAS", "three", "TRELLIS_JS_REPLICAS must be an integer"),
        ("TRELLIS_METRICS_PORT", "65536", "TRELLIS_METRICS_PORT must be a TCP port (0-65535"),
        ("TRELLIS_METRICS_PORT", "http", "TRELLIS_METRICS_PORT must be a TCP port (0-65535"),
    ],
)
def test_an_unusable_value_is_refused_naming_the_variable(
    variable: str, value: str, complaint: str
) -> None:
    with pytest.raises(SettingsError) as err:
        Settings.from_env({variable: value})
    assert str(err.value).startswith(complaint)


def test_the_redfish_driver_is_configured_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "TRELLIS_FABRIC": "redfish",
            "TRELLIS_REDFISH_URL": "https://fm.example:8443/redfish/v1",
            "TRELLIS_REDFISH_USER": "trellis",
            "TRELLIS_REDFISH_PASSWORD": "s3cret",
            "TRELLIS_REDFISH_FABRIC": "PCIe",
            "TRELLIS_REDFISH_EVENTS": "[::1]:0",
            "TRELLIS_REDFISH_AUTH": "session",
        }
    )
    assert (settings.redfish_user, settings.redfish_password) == ("trellis", "s3cret")
    assert settings.redfish_auth == "session" and Settings.from_env({}).redfish_auth == "basic"
    assert settings.redfish_events == ("::1", 0)
    fabric = fabric_from_settings(settings)
    assert isinstance(fabric, RedfishFabric)
    assert fabric.fabric == "PCIe" and fabric.events_at == ("::1", 0)
    assert fabric.client.origin == "https://fm.example:8443"
    assert Settings.from_env({}).redfish_url is None  # the simulator stays the default
    local = Settings.from_env(
        {"TRELLIS_FABRIC": "redfish", "TRELLIS_REDFISH_URL": "http://localhost:8000"}
    )
    remote = Settings.from_env(
        {"TRELLIS_FABRIC": "redfish", "TRELLIS_REDFISH_URL": "http://fm:8000"}
    )
    drivers = [fabric_from_settings(s) for s in (local, remote)]
    assert all(isinstance(d, RedfishFabric) for d in drivers)
    # Events need an address the service reaches: for one on this machine, the loopback.
    assert [getattr(d, "events_at", "?") for d in drivers] == [("127.0.0.1", 0), None]


def test_the_fabric_state_lives_in_the_data_dir_unless_configured(tmp_path: Path) -> None:
    assert fabric_state_path(Settings(data_dir=tmp_path)) == tmp_path / "fabric-sim.json"
    own = tmp_path / "elsewhere" / "hw.json"
    assert fabric_state_path(Settings(data_dir=tmp_path, fabric_state=own)) == own


def test_the_configured_simulator_has_the_knobs_and_the_script_armed(
    tmp_path: Path,
) -> None:
    settings = Settings.from_env(
        {
            "TRELLIS_DATA_DIR": str(tmp_path),
            "TRELLIS_FABRIC_SEED": "3",
            "TRELLIS_FABRIC_LATENCY_MS": "5",
            "TRELLIS_FABRIC_FAILURE_RATE": "0.25",
            "TRELLIS_FABRIC_HANG_RATE": "0.5",
            "TRELLIS_FABRIC_SCRIPT": "hang:bind*2,fail:unbind",
        }
    )
    fabric = fabric_from_settings(settings)
    assert isinstance(fabric, SimulatedFabric)
    assert (fabric.seed, fabric.latency, fabric.failure_rate, fabric.hang_rate) == (
        3,
        0.005,
        0.25,
        0.5,
    )
    assert fabric.state_file == tmp_path / "fabric-sim.json"
    assert fabric.pending_faults == 3


def test_the_cli_reports_a_bad_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRELLIS_FABRIC", "h3")
    assert cli.main(["up"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "trellis: config: TRELLIS_FABRIC='h3' names no fabric driver; valid: sim, redfish"
        " (hint: see docs/configuration.md)\n"
    )


def test_a_state_file_that_cannot_be_read_stops_trellis_up_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "fabric.json"
    state.write_text("half a fil")
    monkeypatch.setenv("TRELLIS_FABRIC_STATE", str(state))
    # Servers nobody listens on: were the file read too late, `up` would fail, not serve.
    monkeypatch.setenv("TRELLIS_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("TRELLIS_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/none")
    with pytest.raises(SettingsError, match=f"TRELLIS_FABRIC_STATE: {state} is not a simulated"):
        fabric_from_settings(Settings.from_env())
    assert cli.main(["up"]) == 1  # before any server starts
    err = capsys.readouterr().err
    assert err.startswith(f"trellis: config: TRELLIS_FABRIC_STATE: {state} is not")


def test_an_owner_url_without_an_engine_url_is_refused() -> None:
    with pytest.raises(SettingsError, match="TRELLIS_DATABASE_URL is not"):
        Settings.from_env({"TRELLIS_DATABASE_OWNER_URL": "postgresql://owner@p/db"})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://engine:s3cret@db:5432/trellis", "postgresql://engine@db:5432/trellis"),
        (
            "postgresql://engine@db/trellis?password=s3cret&sslmode=require",
            "postgresql://engine@db/trellis?sslmode=require",
        ),
        ("nats://n1:4222,nats://user:s3cret@n2:4222", "nats://n1:4222,nats://user@n2:4222"),
        ("nats://s3cret@n1:4222", "nats://***@n1:4222"),  # a token
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_urls_are_shown_without_their_secrets(url: str, shown: str) -> None:
    assert redacted(url) == shown
