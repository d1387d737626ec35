"""Ansible inventory plugin `fleet`: the fleet's servers, read from its API (docs/ansible.md).

Two halves: `fetch` (HTTP, stdlib urllib only, so the plugin needs nothing on the controller
beyond ansible-core) and `build_inventory` (API JSON -> groups and host variables, pure: the
unit tests call it without Ansible running). The Ansible glue is the `InventoryModule` class.
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# ansible-core ships no type information; (mypy may also resolve `ansible.plugins` to this
# checkout's ansible/ folder.)
from ansible.errors import AnsibleParserError  # type: ignore[import-untyped]

from ansible.plugins.inventory import (  # type: ignore[import-untyped,attr-defined,unused-ignore]
    BaseInventoryPlugin,
    Constructable,
)

DOCUMENTATION = r"""
name: fleet
short_description: Fleet's GPU servers as an Ansible inventory
description:
  - Reads every server from the fleet API (C(GET /api/v1/servers), all pages) and the
    deployments (C(GET /api/v1/deployments)), and groups the servers by site, rack, pool,
    lifecycle state, GPU model and deployment.
  - Host variables describe the server (site, rack, state, GPU model and count, BMC protocol,
    deployment and its disruption budget, agent version, pinned SSH host key); never a
    credential.
  - A server without an SSH address is still listed, without C(ansible_host), in group C(no_ssh).
  - The configuration file's name must end in C(fleet.yml) or C(fleet.yaml).
extends_documentation_fragment:
  - constructed
options:
  plugin:
    description: The name of this plugin; always C(fleet).
    required: true
    choices: ['fleet']
  url:
    description: The fleet service's base URL (the API is under C(/api/v1)).
    type: str
    default: http://127.0.0.1:8080
    env:
      - name: FLEET_URL
  token:
    description:
      - A fleet API token; a C(viewer) token is enough (C(fleetctl token create --role viewer)).
      - Better given in the environment than written in the file.
    type: str
    env:
      - name: FLEET_TOKEN
  timeout:
    description: Seconds to wait for each API answer.
    type: float
    default: 10
  validate_certs:
    description: Verify the fleet's TLS certificate (https URLs).
    type: bool
    default: true
  ca_path:
    description: A PEM bundle of CAs to verify the fleet's certificate against.
    type: path
    env:
      - name: FLEET_CA_BUNDLE
  page_size:
    description: Servers asked for per request (the fleet caps it at its C(max_page_size)).
    type: int
    default: 500
"""

EXAMPLES = r"""
# fleet.yml
plugin: fleet
url: https://fleet.example:8080
# token: from FLEET_TOKEN
keyed_groups:
  - key: fleet_health_verdict
    prefix: health
"""

NAME = "fleet"
API = "/api/v1"
# A fleet far beyond any real one: the paging loop stops here whatever the API says.
MAX_PAGES = 10_000
MAX_ERROR_DETAIL = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")

# ServerPublic field -> host variable (docs/ansible.md lists them). Never a BMC username or
# address, a password flag or an agent URL: only what a play needs to pick and describe hosts.
HOST_FIELDS: dict[str, str] = {
    "name": "fleet_server",
    "site": "fleet_site",
    "rack": "fleet_rack",
    "pool": "fleet_pool",
    "state": "fleet_state",
    "gpu_model": "fleet_gpu_model",
    "gpu_count": "fleet_gpu_count",
    "bmc_protocol": "fleet_bmc_protocol",
    "agent_version": "fleet_agent_version",
    "ssh_host_key": "fleet_ssh_host_key",
    "health_verdict": "fleet_health_verdict",
}
# Server field -> group prefix.
GROUPED_BY: dict[str, str] = {
    "site": "site",
    "rack": "rack",
    "pool": "pool",
    "state": "state",
    "gpu_model": "gpu",
    "deployment": "deployment",
}
NO_SSH_GROUP = "no_ssh"


class FleetApiError(Exception):
    """One line, never the token: what failed and what to do about it."""


def group_name(prefix: str, value: object) -> str:
    """`rack` + `fra1-r01` -> `rack_fra1_r01`: lower case, anything but letters, digits and `_`
    replaced by `_` (an Ansible group name is a valid identifier). The upgrade playbook builds
    `deployment_<name>` the same way."""
    return f"{prefix}_{_UNSAFE.sub('_', str(value)).lower()}"


@dataclass
class Inventory:
    """Groups (name -> host names, sorted) and variables per host."""

    groups: dict[str, list[str]] = field(default_factory=dict)
    hostvars: dict[str, dict[str, Any]] = field(default_factory=dict)


def build_inventory(
    servers: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]]
) -> Inventory:
    """The fleet's API answers -> the inventory. Pure: plain data in, plain data out."""
    budgets = {d["name"]: d.get("disruption_budget") for d in deployments}
    # `no_ssh` always exists (maybe empty): the playbooks' `all:!no_ssh` names it.
    members: dict[str, set[str]] = {NO_SSH_GROUP: set()}
    hostvars: dict[str, dict[str, Any]] = {}
    for server in servers:
        name = str(server["name"])
        hostvars_ = {var: server.get(key) for key, var in HOST_FIELDS.items()}
        deployment = server.get("deployment")
        hostvars_["fleet_deployment"] = deployment
        hostvars_["fleet_disruption_budget"] = budgets.get(deployment) if deployment else None
        if server.get("ssh_address"):
            hostvars_["ansible_host"] = server["ssh_address"]
            hostvars_["ansible_port"] = server.get("ssh_port") or 22
        else:
            members.setdefault(NO_SSH_GROUP, set()).add(name)
        for key, prefix in GROUPED_BY.items():
            value = server.get(key)
            if value not in (None, ""):
                members.setdefault(group_name(prefix, value), set()).add(name)
        hostvars[name] = hostvars_
    return Inventory(
        groups={group: sorted(hosts) for group, hosts in sorted(members.items())},
        hostvars=hostvars,
    )


# -------------------------------------------------------------------------------------------
# The API


@dataclass(frozen=True)
class Connection:
    url: str
    token: str
    timeout_s: float = 10.0
    validate_certs: bool = True
    ca_path: str | None = None

    @property
    def where(self) -> str:
        """The fleet's address for messages: scheme, host and port (no path, no userinfo)."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or "?"
        return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


Opener = Callable[[urllib.request.Request, float, ssl.SSLContext | None], Any]


def _urlopen(
    request: urllib.request.Request, timeout: float, context: ssl.SSLContext | None
) -> Any:
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def _context(conn: Connection) -> ssl.SSLContext | None:
    if not conn.url.startswith("https://"):
        return None
    if not conn.validate_certs:
        return ssl._create_unverified_context()
    return ssl.create_default_context(cafile=conn.ca_path)


def _detail(error: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(error.read(64 * 1024) or b"{}")
        detail = body.get("detail") if isinstance(body, dict) else None
    except (ValueError, OSError):
        detail = None
    text = " ".join(str(detail).split()) if detail else ""
    return text[:MAX_ERROR_DETAIL]


def get_json(conn: Connection, path: str, opener: Opener = _urlopen) -> Any:
    """GET one API path; FleetApiError (one line, no token) on any failure."""
    url = conn.url.rstrip("/") + API + path
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {conn.token}", "Accept": "application/json"}
    )
    try:
        with opener(request, conn.timeout_s, _context(conn)) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        detail = _detail(error)
        if error.code in (401, 403):
            raise FleetApiError(
                f"the fleet at {conn.where} refused the token ({error.code}"
                + (f": {detail}" if detail else "")
                + "): give a valid viewer token in FLEET_TOKEN "
                "(fleetctl token create --role viewer)"
            ) from None
        raise FleetApiError(
            f"GET {API}{path.split('?')[0]} at {conn.where} answered {error.code}"
            + (f": {detail}" if detail else "")
        ) from None
    except (TimeoutError, urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        if isinstance(reason, TimeoutError) or isinstance(error, TimeoutError):
            reason = f"no answer within {conn.timeout_s:g} s"
        raise FleetApiError(
            f"cannot reach the fleet at {conn.where}: {reason} (check FLEET_URL / url:)"
        ) from None
    except ValueError:
        raise FleetApiError(
            f"GET {API}{path.split('?')[0]} at {conn.where} did not answer JSON: is FLEET_URL "
            "the fleet service?"
        ) from None


def get_all(conn: Connection, path: str, page_size: int, opener: Opener = _urlopen) -> list[Any]:
    """Every row of a paged list (`{count, next, previous, results}`), by offset."""
    rows: list[Any] = []
    for _ in range(MAX_PAGES):
        sep = "&" if "?" in path else "?"
        page = get_json(conn, f"{path}{sep}limit={page_size}&offset={len(rows)}", opener)
        if not isinstance(page, dict) or not isinstance(page.get("results"), list):
            raise FleetApiError(f"GET {API}{path} at {conn.where}: not a page of results")
        rows.extend(page["results"])
        if not page["results"] or len(rows) >= int(page.get("count", 0)):
            return rows
    raise FleetApiError(f"GET {API}{path} at {conn.where}: more than {MAX_PAGES} pages")


def fetch(conn: Connection, page_size: int = 500, opener: Opener = _urlopen) -> Inventory:
    servers = get_all(conn, "/servers", page_size, opener)
    deployments = get_all(conn, "/deployments", page_size, opener)
    return build_inventory(servers, deployments)


# -------------------------------------------------------------------------------------------
# Ansible


class InventoryModule(BaseInventoryPlugin, Constructable):  # type: ignore[misc]
    NAME = NAME

    def verify_file(self, path: str) -> bool:
        return bool(super().verify_file(path)) and path.endswith(("fleet.yml", "fleet.yaml"))

    def parse(self, inventory: Any, loader: Any, path: str, cache: bool = True) -> None:
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        token = self.get_option("token")
        if not token:
            raise AnsibleParserError(
                "fleet inventory: no token: set FLEET_TOKEN (a viewer token: "
                "fleetctl token create --role viewer)"
            )
        conn = Connection(
            url=str(self.get_option("url")),
            token=str(token),
            timeout_s=float(self.get_option("timeout")),
            validate_certs=bool(self.get_option("validate_certs")),
            ca_path=self.get_option("ca_path"),
        )
        try:
            found = fetch(conn, int(self.get_option("page_size")))
        except FleetApiError as error:
            raise AnsibleParserError(f"fleet inventory: {error}") from None
        self._populate(found)

    def _populate(self, found: Inventory) -> None:
        strict = self.get_option("strict")
        for host, variables in found.hostvars.items():
            self.inventory.add_host(host)
            for key, value in variables.items():
                self.inventory.set_variable(host, key, value)
            # The `constructed` options (compose, groups, keyed_groups) for the operator's own.
            self._set_composite_vars(self.get_option("compose"), variables, host, strict)
            self._add_host_to_composed_groups(self.get_option("groups"), variables, host, strict)
            self._add_host_to_keyed_groups(self.get_option("keyed_groups"), variables, host, strict)
        for group, hosts in found.groups.items():
            self.inventory.add_group(group)
            for host in hosts:
                self.inventory.add_child(group, host)
