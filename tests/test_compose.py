"""deploy/compose.yaml: no fixed credential in it; the `credentials` service makes them at random
once (run here with sh, as compose runs it), Redis asks for its password, and every Quilt process
starts through the entrypoint that reads them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def _as_compose_runs_it(text: str, credentials: Path) -> str:
    return text.replace("$$", "$").replace("/run/credentials", str(credentials))


def test_no_credential_is_written_in_the_file():
    text = (ROOT / "deploy" / "compose.yaml").read_text()
    assert "quilt:quilt@" not in text and "POSTGRES_PASSWORD:" not in text and "QUILT_SECRET_KEY:" not in text
    services = COMPOSE["services"]
    assert "--requirepass" in services["redis"]["command"][0]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/credentials/postgres_password"
    for name in ("migrate", "api", "trainer", "celery"):
        assert services[name]["entrypoint"][0:2] == ["sh", "-c"], name
        assert services[name]["depends_on"]["credentials"]["condition"] == "service_completed_successfully"


def test_the_credentials_are_made_once_at_random_and_reach_quilts_processes(tmp_path):
    script = _as_compose_runs_it(COMPOSE["services"]["credentials"]["command"][0], tmp_path)
    subprocess.run(["sh", "-c", script], check=True, timeout=30)
    first = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert set(first) == {"postgres_password", "redis_password", "quilt.env"}
    assert len(first["postgres_password"]) == 48 and first["postgres_password"] != first["redis_password"]
    subprocess.run(["sh", "-c", script], check=True, timeout=30)  # a restart keeps them
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == first

    entrypoint = [_as_compose_runs_it(part, tmp_path) for part in COMPOSE["x-quilt"]["entrypoint"]]
    env = subprocess.run([*entrypoint, "env"], check=True, capture_output=True, text=True, timeout=30).stdout
    values = dict(line.split("=", 1) for line in env.splitlines() if line.startswith("QUILT_"))
    assert values["QUILT_DATABASE_URL"] == f"postgresql://quilt:{first['postgres_password']}@postgres:5432/quilt"
    assert values["QUILT_REDIS_URL"] == f"redis://:{first['redis_password']}@redis:6379/0"
    assert len(values["QUILT_SECRET_KEY"]) == 96

    other = tmp_path / "another"
    other.mkdir()
    subprocess.run(["sh", "-c", _as_compose_runs_it(COMPOSE["services"]["credentials"]["command"][0], other)],
                   check=True, timeout=30)
    assert (other / "postgres_password").read_text() != first["postgres_password"]
