"""/openapi.json shows every answer's shape: each /api/v1 operation documents a 2xx body whose
schema says what it holds (no `{}`, no bare `object`), and no answer has a field for a secret.

The exceptions, each for a reason of its own:
- DELETE /schedules/{entry_id} and DELETE /models/{model}/versions/{version}: 204, no body.
- GET /inventory/export: YAML, not JSON; its schema is the inventory file's (`InventoryFile`).
- POST /power also streams NDJSON (`Accept: application/x-ndjson`): its JSON answer has a schema,
  the stream's lines are described in words.
"""

from __future__ import annotations

from typing import Any

from factories import TEST_SECRET_KEY
from pydantic import SecretStr

from fleet import db
from fleet.api.app import create_app
from fleet.settings import Settings

API = "/api/v1"
REF = "#/components/schemas/"
NO_BODY = {
    ("delete", f"{API}/schedules/{{entry_id}}"),
    ("delete", f"{API}/models/{{model}}/versions/{{version}}"),
}
YAML_ANSWERS = {("get", f"{API}/inventory/export"): "InventoryFile"}
STREAMS = {("post", f"{API}/power"): "application/x-ndjson"}
# A download, not JSON: a diagnostic bundle (a gzipped tar).
BINARY_ANSWERS = {("get", f"{API}/diagnostics/{{bundle_id}}"): "application/gzip"}
# Field names that would carry a secret (the server's `bmc_password_set` says only whether).
SECRET_WORDS = {"password", "token", "key", "secret", "hash"}
NOT_SECRETS = {"bmc_password_set"}
# The agent-token mint and rotate answers carry the new token: the one time it is shown
# (docs/api.md "Agent tokens"). `ssh_host_key` is a public key's fingerprint.
SHOWN_ONCE = {("post", f"{API}/tokens/agent"), ("post", f"{API}/tokens/{{token_id}}/rotate")}
# The routers' view of the client keys carries their hashes (routers match requests by them;
# the router role, not viewers: docs/api.md "Tenants and client keys").
SHOWN_TO_ROUTERS = {(("get", f"{API}/routing/callers"), "hash")}
NOT_SECRETS |= {"ssh_host_key"}
# A model version's name, "<model>@<version>" (fleet_core.wire.ModelRef, fleet/catalog/).
NOT_SECRETS |= {"key"}
_ANNOTATIONS = {"title", "description", "default", "examples", "deprecated"}


def _spec() -> dict[str, Any]:
    settings = Settings(
        database_url="sqlite://", secret_key=SecretStr(TEST_SECRET_KEY.decode()), run_loops=False
    )
    return create_app(settings, db.make_engine("sqlite://"), migrate=False).openapi()


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, item in spec["paths"].items()
        if path.startswith(f"{API}/")
        for method, operation in item.items()
    ]


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].removeprefix(REF)]
    return schema


def _says_nothing(schema: dict[str, Any]) -> bool:
    """`{}` (any value), or an object that names no property and types none of its values:
    what a handler returning `dict[str, Any]` documents."""
    if set(schema) <= _ANNOTATIONS:
        return True
    if schema.get("type") == "object" and "properties" not in schema:
        values = schema.get("additionalProperties", True)
        return values is True or values == {}
    return False


def _reachable(spec: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    """`schema` and every schema it contains or refers to, each component once."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.removeprefix(REF)
            if name not in seen:
                seen.add(name)
                stack.append(spec["components"]["schemas"][name])
            continue
        out.append(node)
        stack.extend(node.get("properties", {}).values())
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            stack.extend(node.get(key, []))
        for key in ("items", "additionalProperties"):
            stack.append(node.get(key))
    return out


def _answers(operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {code: r for code, r in operation["responses"].items() if code.startswith("2")}


def test_every_api_operation_documents_the_shape_of_its_answer() -> None:
    spec = _spec()
    operations = _operations(spec)
    assert len(operations) > 40, "the routes moved from /api/v1?"
    for method, path, operation in operations:
        where = f"{method.upper()} {path}"
        answers = _answers(operation)
        assert len(answers) == 1, f"{where}: one success status, not {sorted(answers)}"
        [(code, answer)] = answers.items()
        content = answer.get("content", {})
        if (method, path) in NO_BODY:
            assert code == "204" and not content, f"{where}: 204 without a body"
            continue
        if (method, path) in YAML_ANSWERS:
            name = YAML_ANSWERS[(method, path)]
            assert content["application/yaml"]["schema"] == {"$ref": REF + name}, where
            continue
        if (method, path) in BINARY_ANSWERS:
            assert set(content) == {BINARY_ANSWERS[(method, path)]}, where
            schema = content[BINARY_ANSWERS[(method, path)]]["schema"]
            assert schema == {"type": "string", "format": "binary"}, where
            continue
        if (method, path) in STREAMS:
            assert STREAMS[(method, path)] in content, f"{where}: the stream is documented"
        schema = content["application/json"]["schema"]
        assert not _says_nothing(_resolve(spec, schema)), f"{where}: {code} says nothing"


def test_the_probes_document_their_answers() -> None:
    spec = _spec()
    for path in ("/healthz", "/readyz"):
        schema = spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
        assert not _says_nothing(_resolve(spec, schema["schema"])), path
    ready = spec["paths"]["/readyz"]["get"]["responses"]["503"]["content"]["application/json"]
    assert _resolve(spec, ready["schema"])["properties"].keys() == {"status", "checks"}


def test_no_answer_has_a_field_for_a_secret() -> None:
    """BMC passwords, token hashes and agents' API keys never leave the service: no response
    schema names such a field (a response model drops what it does not declare). The export's
    YAML is left out: its schema is the inventory file's, uploads included, which may carry a
    password; the export never does (tests/unit/test_inventory.py,
    tests/e2e/worlds/test_secrets.py)."""
    spec = _spec()
    for method, path, operation in _operations(spec):
        for answer in _answers(operation).values():
            json_body = answer.get("content", {}).get("application/json")
            if json_body is not None:
                for node in _reachable(spec, json_body["schema"]):
                    for field in node.get("properties", {}):
                        secret = bool(SECRET_WORDS & set(field.lower().split("_")))
                        shown_once = (method, path) in SHOWN_ONCE and field == "token"
                        shown_once |= ((method, path), field) in SHOWN_TO_ROUTERS
                        assert not secret or field in NOT_SECRETS or shown_once, (
                            method,
                            path,
                            field,
                        )


def test_lists_page_or_list_with_their_row_type() -> None:
    """Paged lists are `Page[Row]` ({count, next, previous, results}); the rest `Listing[Row]`."""
    spec = _spec()
    paged = {"/sites", "/racks", "/feeds", "/servers", "/servers/{name}/gpus", "/gpus"}
    paged |= {"/deployments", "/events", "/tokens"}
    for path in paged:
        schema = spec["paths"][API + path]["get"]["responses"]["200"]["content"]
        page = _resolve(spec, schema["application/json"]["schema"])
        assert page["properties"].keys() == {"count", "next", "previous", "results"}, path
        assert "$ref" in page["properties"]["results"]["items"], path
        parameters = spec["paths"][API + path]["get"]["parameters"]
        assert {"limit", "offset"} <= {p["name"] for p in parameters}, path
