"""Model versions through the REST API and `fleetctl models` (docs/api.md "Model versions"),
on a real uvicorn server over SQLite and Postgres: roles, clear 4xx answers, inventory files
with `models:`, and deployments created with a version or the legacy URI and checksum."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from live import YAML, Live, serve
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from fleet.cli import app as cli_app
from fleet.models import Role

API = "/api/v1"
SHA_A, SHA_B = "a" * 64, "b" * 64
VERSION: dict[str, Any] = {
    "model": "llama-8b",
    "version": "v1",
    "description": "Llama 3.1 8B Instruct, FP8",
    "artifacts": [
        {
            "name": "config.json",
            "uri": "http://10.0.0.9/llama/config.json",
            "sha256": SHA_A,
            "size_bytes": 120,
        },
        {
            "name": "model.safetensors",
            "uri": "s3://weights/llama/model.safetensors",
            "sha256": SHA_B,
            "size_bytes": 8_000_000_000,
        },
    ],
}
DEPLOYMENT: dict[str, Any] = {
    "name": "chat",
    "engine_params": {"backend": "pytorch", "tp_size": 1, "pp_size": 1},
    "gpus_per_replica": 1,
    "gpu_models": ["H100"],
    "max_replicas": 2,
    "sla_p95_latency_ms": 2000,
    "sla_ttft_ms": 300,
}


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("models-api")) as server:
        yield server


@pytest.fixture
def clients(live: Live, db: Engine) -> Iterator[dict[str, httpx.Client]]:
    yield {
        "operator": live.client(live.token(Role.OPERATOR, name="operator")),
        "viewer": live.client(live.token(Role.VIEWER, name="viewer")),
    }
    live.close_clients()


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    return response.json() if response.content else None


def detail(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    text = response.json()["detail"]
    assert isinstance(text, str) and "\n" not in text
    return text


def with_artifact(**changes: Any) -> dict[str, Any]:
    return {**VERSION, "artifacts": [{**VERSION["artifacts"][0], **changes}]}


def test_operators_create_and_delete_viewers_read(clients: dict[str, httpx.Client]) -> None:
    operator, viewer = clients["operator"], clients["viewer"]
    assert "operator role" in detail(viewer.post(f"{API}/models", json=VERSION), 403)
    created = ok(operator.post(f"{API}/models", json=VERSION), 201)
    assert (created["key"], created["size_bytes"]) == ("llama-8b@v1", 8_000_000_120)
    assert created["digest"].startswith("sha256:") and created["external"] is False
    page = ok(viewer.get(f"{API}/models", params={"model": "llama-8b"}))
    assert [r["key"] for r in page["results"]] == ["llama-8b@v1"] and page["count"] == 1
    one = ok(viewer.get(f"{API}/models/llama-8b/versions/v1"))
    assert one["deployments"] == [] and one["cached_on"] == []
    held = ok(viewer.get(f"{API}/models/llama-8b/versions/v1/servers"))
    assert held == {"count": 0, "results": []}
    assert "operator role" in detail(viewer.delete(f"{API}/models/llama-8b/versions/v1"), 403)
    assert operator.delete(f"{API}/models/llama-8b/versions/v1").status_code == 204
    assert "no model version llama-8b@v1" in detail(
        viewer.get(f"{API}/models/llama-8b/versions/v1"), 404
    )


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        (with_artifact(uri="gopher://h/x"), 400, "artifacts[0].uri: unknown URI scheme 'gopher'"),
        (with_artifact(sha256="xyz"), 400, "artifacts[0].sha256: expected 64 lowercase hex"),
        (with_artifact(name="../x"), 400, "artifacts[0].name: must not contain"),
        (with_artifact(size_bytes=-1), 422, "body.artifacts[0].size_bytes: must be ≥ 0"),
        ({**VERSION, "model": "a/b"}, 422, "body.model: "),
        ({**VERSION, "artifacts": []}, 422, "artifacts"),
    ],
)
def test_bad_versions_are_clear_4xx(
    clients: dict[str, httpx.Client], body: dict[str, Any], status: int, expected: str
) -> None:
    response = clients["operator"].post(f"{API}/models", json=body)
    assert response.status_code == status, response.text
    assert expected in response.text, response.text
    assert ok(clients["viewer"].get(f"{API}/models"))["count"] == 0


def test_a_duplicate_is_409_and_a_version_in_use_cannot_go(
    clients: dict[str, httpx.Client],
) -> None:
    operator = clients["operator"]
    ok(operator.post(f"{API}/models", json=VERSION), 201)
    assert "already exists" in detail(operator.post(f"{API}/models", json=VERSION), 409)
    deployment = ok(
        operator.post(f"{API}/deployments", json={**DEPLOYMENT, "model_version": "llama-8b@v1"}),
        201,
    )
    assert (deployment["model_version"], deployment["model_uri"]) == ("llama-8b@v1", "llama-8b")
    assert deployment["canary_version"] is None and deployment["rollout"] == {}
    text = detail(operator.delete(f"{API}/models/llama-8b/versions/v1"), 409)
    assert "in use by deployment chat (stable)" in text
    one = ok(clients["viewer"].get(f"{API}/models/llama-8b/versions/v1"))
    assert one["deployments"] == [{"deployment": "chat", "as": "stable"}]


def test_legacy_deployments_still_work_and_bad_ones_say_what_to_give(
    clients: dict[str, httpx.Client],
) -> None:
    operator = clients["operator"]
    uri, checksum = "s3://fleet-models/qwen/Qwen2.5-7B", "sha256:0123"
    legacy = ok(
        operator.post(
            f"{API}/deployments",
            json={**DEPLOYMENT, "model_uri": uri, "model_checksum": checksum},
        ),
        201,
    )
    name = "legacy-" + hashlib.sha256(f"{uri}\n{checksum}".encode()).hexdigest()[:12]
    assert legacy["model_version"] == f"Qwen2.5-7B@{name}"
    assert (legacy["model_uri"], legacy["model_checksum"]) == (uri, checksum)
    external = ok(clients["viewer"].get(f"{API}/models/Qwen2.5-7B/versions/{name}"))
    assert external["external"] is True and external["artifacts"][0]["format"] == "external"
    missing = {**DEPLOYMENT, "name": "other"}
    assert "model_version" in detail(operator.post(f"{API}/deployments", json=missing), 400)
    unknown = {**missing, "model_version": "nope@v1"}
    text = detail(operator.post(f"{API}/deployments", json=unknown), 400)
    assert text.startswith("model_version: no model version 'nope@v1'"), text


def test_inventory_files_carry_versions_and_round_trip(
    clients: dict[str, httpx.Client],
) -> None:
    operator = clients["operator"]
    doc = {
        "models": [VERSION],
        "deployments": [
            {
                "name": "chat",
                "model_version": "llama-8b@v1",
                "engine": {"backend": "pytorch"},
                "gpu_models": ["H100"],
                "sla": {"p95_latency_ms": 2000, "ttft_ms": 300},
                "cached_spares": 2,
            },
            {
                "name": "legacy",
                "model": {"uri": "file:///models/old-model", "checksum": "sha256:00"},
                "sla": {"p95_latency_ms": 2000, "ttft_ms": 300},
            },
        ],
    }
    text = yaml.safe_dump(doc)
    report = ok(operator.post(f"{API}/inventory/import", content=text, headers=YAML))
    assert report["created"]["model_version"] == 1 and report["created"]["deployment"] == 2
    chat = ok(clients["viewer"].get(f"{API}/deployments/chat"))
    assert (chat["model_version"], chat["cached_spares"]) == ("llama-8b@v1", 2)
    again = ok(operator.post(f"{API}/inventory/import", content=text, headers=YAML))
    assert again["changes"] == []
    response = operator.get(f"{API}/inventory/export")
    assert response.status_code == 200, response.text
    exported = yaml.safe_load(response.text)
    assert [m["model"] + "@" + m["version"] for m in exported["models"]] == ["llama-8b@v1"]
    by_name = {d["name"]: d for d in exported["deployments"]}
    assert by_name["chat"]["model_version"] == "llama-8b@v1"
    assert by_name["legacy"]["model"] == {
        "uri": "file:///models/old-model",
        "checksum": "sha256:00",
    }
    back = ok(
        operator.post(f"{API}/inventory/import", content=yaml.safe_dump(exported), headers=YAML)
    )
    assert back["changes"] == []
    # Versions are immutable: the same name with another file is refused, naming the place.
    changed = {**doc, "models": [with_artifact(sha256="c" * 64)]}
    refused = operator.post(
        f"{API}/inventory/import", content=yaml.safe_dump(changed), headers=YAML
    )
    assert refused.status_code == 400 and "models[0]: model version llama-8b@v1 exists" in (
        refused.text
    )


def test_models_cached_in_a_file_is_refused_with_the_reason(
    clients: dict[str, httpx.Client],
) -> None:
    server = {
        "name": "gpu-1",
        "rack": "r1",
        "u": 1,
        "bmc": {
            "protocol": "redfish",
            "address": "10.0.0.1",
            "port": 443,
            "username": "a",
            "password": "p",
        },
        "gpu": {"model": "H100", "count": 8},
        "power": {"idle_w": 2000, "standby_w": 50, "max_w": 10000},
        "models_cached": ["s3://x/y"],
    }
    response = clients["operator"].post(
        f"{API}/inventory/validate", content=yaml.safe_dump({"servers": [server]}), headers=YAML
    )
    assert response.status_code == 422, response.text
    assert "servers[0]: " in response.text and "agent reports" in response.text


def test_fleetctl_models(clients: dict[str, httpx.Client], live: Live, tmp_path: Path) -> None:
    env = {"FLEET_URL": live.url, "FLEET_TOKEN": live.token(Role.OPERATOR, name="cli")}
    runner = CliRunner(env=env)
    base: list[str] = []
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "sub" / "w.bin").write_bytes(b"\0" * 1000)
    (checkpoint / ".hidden").write_text("skip me")
    made = runner.invoke(
        cli_app,
        [
            "models",
            "create",
            "tiny@v1",
            "--from-dir",
            str(checkpoint),
            "--base-uri",
            "http://127.0.0.1:8099/tiny",
            *base,
        ],
    )
    assert made.exit_code == 0, made.output
    assert made.output.startswith("tiny@v1: 2 file(s), 1,002 bytes, sha256:")
    shown = ok(clients["viewer"].get(f"{API}/models/tiny/versions/v1"))
    assert [(a["name"], a["uri"], a["sha256"]) for a in shown["artifacts"]] == [
        (
            "config.json",
            "http://127.0.0.1:8099/tiny/config.json",
            hashlib.sha256(b"{}").hexdigest(),
        ),
        (
            "sub/w.bin",
            "http://127.0.0.1:8099/tiny/sub/w.bin",
            hashlib.sha256(b"\0" * 1000).hexdigest(),
        ),
    ]
    flags = runner.invoke(
        cli_app,
        [
            "models",
            "create",
            "tiny@v2",
            "--artifact",
            f"name=w.bin,uri=ftp://h/w.bin,sha256={SHA_A},size=3",
            *base,
        ],
    )
    assert flags.exit_code != 0 and "unknown URI scheme 'ftp'" in flags.output
    listed = runner.invoke(cli_app, ["models", "list", "-o", "json", *base])
    assert listed.exit_code == 0 and '"tiny@v1"' in listed.output
    where = runner.invoke(cli_app, ["models", "where", "tiny@v1", *base])
    assert where.exit_code == 0, where.output
    dep = runner.invoke(
        cli_app,
        [
            "deployments",
            "create",
            "tiny-chat",
            "--model-version",
            "tiny@v1",
            "--sla-p95-ms",
            "2000",
            "--sla-ttft-ms",
            "300",
            "-o",
            "json",
            *base,
        ],
    )
    assert dep.exit_code == 0 and '"model_version": "tiny@v1"' in dep.output, dep.output
    gone = runner.invoke(cli_app, ["models", "delete", "tiny@v1", *base])
    assert gone.exit_code != 0 and "in use by deployment tiny-chat" in gone.output
