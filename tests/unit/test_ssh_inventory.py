"""A server's SSH block in inventory files (`ssh: {address, port, host_key}`) and its SSH fields
over `PATCH /servers/{name}`, on both databases: imported, exported back, kept when a file
leaves them out (a key pinned by `ssh-trust` survives re-importing an older file), and a pinned
host key changed only by an admin. Bad values are refused naming their place."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from fleet.crypto import SecretBox
from fleet.db import session_scope
from fleet.errors import ForbiddenError, ValidationFailed
from fleet.inventory import ImportReport, export_inventory, import_inventory, parse_inventory
from fleet.inventory.servers import update_server
from fleet.models import Event, Server, ServerUpdate

PIN = "SHA256:" + "a" * 43
OTHER = "SHA256:" + "B" * 43
ACTOR = "tests:ssh-inventory"


def doc(ssh: dict[str, Any] | None = None) -> dict[str, Any]:
    server: dict[str, Any] = {
        "name": "s1",
        "u": 1,
        "bmc": {
            "protocol": "redfish",
            "address": "127.0.0.1",
            "port": 8000,
            "username": "admin",
            "password": "pw-never-echoed",
        },
        "gpu": {"model": "H100", "count": 8},
        "power": {"idle_w": 1900, "standby_w": 90, "max_w": 10_200},
    }
    if ssh is not None:
        server["ssh"] = ssh
    return {"sites": [{"name": "lab", "racks": [{"name": "r1", "servers": [server]}]}]}


def run(engine: Engine, box: SecretBox, source: dict[str, Any], **kw: Any) -> ImportReport:
    with session_scope(engine) as session:
        return import_inventory(session, parse_inventory(yaml.safe_dump(source)), box, ACTOR, **kw)


def ssh_of(engine: Engine) -> tuple[str | None, int, str | None]:
    with Session(engine) as session:
        s = session.exec(select(Server).where(Server.name == "s1")).one()
        return s.ssh_address, s.ssh_port, s.ssh_host_key


@pytest.fixture
def box(secret_key: bytes) -> SecretBox:
    return SecretBox(secret_key)


def test_the_ssh_block_is_imported_exported_and_kept_when_left_out(
    db: Engine, box: SecretBox
) -> None:
    run(db, box, doc({"address": "10.0.0.5", "host_key": PIN}))
    assert ssh_of(db) == ("10.0.0.5", 22, PIN)
    with Session(db) as session:
        [rack] = export_inventory(session)["sites"][0]["racks"]
    [server] = rack["servers"]
    assert server["ssh"] == {"address": "10.0.0.5", "port": 22, "host_key": PIN}
    # The export imports back unchanged.
    with Session(db) as session:
        exported = export_inventory(session)
    assert not run(db, box, exported).changed
    # A file without the block (or without the key) keeps what the fleet has.
    assert not run(db, box, doc()).changed
    report = run(db, box, doc({"address": "10.0.0.6", "port": 2222}))
    assert [(c.name, sorted(c.fields)) for c in report.changes] == [
        ("s1", ["ssh_address", "ssh_port"])
    ]
    assert ssh_of(db) == ("10.0.0.6", 2222, PIN)


def test_a_pinned_key_is_replaced_by_a_file_only_for_an_admin(db: Engine, box: SecretBox) -> None:
    run(db, box, doc({"address": "10.0.0.5"}))
    # Pinning where none is pinned is the inventory's to do (an operator's import).
    run(db, box, doc({"address": "10.0.0.5", "host_key": PIN}), credentials_allowed=False)
    assert ssh_of(db)[2] == PIN
    with pytest.raises(ForbiddenError) as refused:
        run(db, box, doc({"address": "10.0.0.5", "host_key": OTHER}), credentials_allowed=False)
    assert "pinned SSH host keys" in str(refused.value) and "ssh_host_key" in str(refused.value)
    assert ssh_of(db)[2] == PIN
    run(db, box, doc({"address": "10.0.0.5", "host_key": OTHER}), credentials_allowed=True)
    assert ssh_of(db)[2] == OTHER


@pytest.mark.parametrize(
    ("ssh", "message"),
    [
        ({"address": "h", "host_key": "SHA256:short"}, "sites[0].racks[0].servers[0].ssh.host_key"),
        (
            {"address": "h", "host_key": "MD5:" + "a" * 43},
            "sites[0].racks[0].servers[0].ssh.host_key",
        ),
        ({"address": "h", "port": 0}, "sites[0].racks[0].servers[0].ssh.port: must be 1-65535"),
        ({"address": ""}, "sites[0].racks[0].servers[0].ssh.address"),
        ({"port": 22}, "sites[0].racks[0].servers[0].ssh.address"),
        ({"address": "h", "user": "root"}, "sites[0].racks[0].servers[0].ssh.user"),
    ],
)
def test_bad_ssh_blocks_are_refused_naming_the_place(ssh: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        parse_inventory(yaml.safe_dump(doc(ssh)))
    assert message in str(exc.value)


def test_patch_sets_ssh_fields_and_only_admins_touch_the_pin(db: Engine, box: SecretBox) -> None:
    run(db, box, doc())
    with Session(db) as session:
        shown = update_server(
            session,
            "s1",
            ServerUpdate(ssh_address="10.0.0.9", ssh_port=2200),
            box,
            "operator:o",
            credentials_allowed=False,
        )
    assert (shown.ssh_address, shown.ssh_port, shown.ssh_host_key) == ("10.0.0.9", 2200, None)
    for update in (ServerUpdate(ssh_host_key=PIN), ServerUpdate(ssh_host_key=None)):
        with Session(db) as session, pytest.raises(ForbiddenError, match="needs the admin role"):
            update_server(session, "s1", update, box, "operator:o", credentials_allowed=False)
    with Session(db) as session:
        shown = update_server(session, "s1", ServerUpdate(ssh_host_key=PIN), box, "admin:a")
        assert shown.ssh_host_key == PIN
        shown = update_server(session, "s1", ServerUpdate(ssh_host_key=None), box, "admin:a")
        assert shown.ssh_host_key is None
        fields = [
            e.details["fields"]
            for e in session.exec(
                select(Event).where(Event.kind == "server.updated").order_by(col(Event.id))
            )
        ]
    assert fields == [["ssh_address", "ssh_port"], ["ssh_host_key"], ["ssh_host_key"]]


def test_patch_refuses_bad_ssh_values() -> None:
    with pytest.raises(ValueError, match="ssh_port"):
        ServerUpdate.model_validate({"ssh_port": 70000})
    with pytest.raises(ValueError, match="ssh_port: must not be null"):
        ServerUpdate.model_validate({"ssh_port": None})
    assert ServerUpdate.model_validate({"ssh_address": None}).ssh_address is None
    # A pin is a fingerprint as OpenSSH prints it, or nothing.
    for bad in ("SHA256:nope", "MD5:" + "a" * 43, "SHA256:" + "a" * 44):
        with pytest.raises(ValueError, match="ssh_host_key"):
            ServerUpdate.model_validate({"ssh_host_key": bad})
