"""Input validation (issue 19): numbers finite and within their columns, booleans not numbers,
engine_params checked as the agent checks them, inventory files bounded in work and errors,
nullable fields truthful in the schema, and the CLI printing no control characters.

The API cases run on SQLite and Postgres (Postgres's 32-bit columns are where out-of-range
integers used to become 500s); the model, inventory and CLI cases are plain data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import typer
import yaml
from factories import TEST_SECRET_KEY
from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from live import YAML, Live, serve
from pydantic import SecretStr, ValidationError
from sqlalchemy.engine import Engine

from fleet import db, validation
from fleet.api.app import create_app
from fleet.api.openapi import NO_CONTROL
from fleet.cli.common import Output, fail, show
from fleet.cli.events import echo_event
from fleet.data import DEMO_INVENTORY
from fleet.errors import ValidationFailed
from fleet.inventory.schema import MAX_ENTRIES, MAX_ERRORS, parse_inventory
from fleet.models import (
    MAX_ENGINE_PARAMS_BYTES,
    DeploymentCreate,
    DeploymentUpdate,
    Role,
    ServerUpdate,
)
from fleet.registry.routing_table import DeploymentLoad
from fleet.settings import Settings

API = "/api/v1"
DEPLOYMENT: dict[str, Any] = {
    "name": "qwen-7b",
    "model_uri": "s3://fleet-models/qwen/Qwen2.5-7B-Instruct",
    "model_checksum": "sha256:0123",
    "engine_params": {"backend": "pytorch", "tp_size": 2, "pp_size": 1},
    "gpus_per_replica": 2,
    "gpu_models": ["H100"],
    "min_replicas": 1,
    "max_replicas": 4,
    "sla_p95_latency_ms": 2000,
    "sla_ttft_ms": 300,
}


# ---------------------------------------------------------------------------------------------
# The API models


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_replicas", True, "must be an integer"),
        ("max_replicas", "4", "must be an integer"),
        ("disruption_budget", 3_320_784_517, "must be ≤"),
        ("sla_ttft_ms", float("inf"), "finite"),
        ("sla_p95_latency_ms", float("nan"), "finite"),
        ("sla_ttft_ms", False, "must be a number"),
        ("sla_ttft_ms", 5e-324, "must be ≥ 1"),
    ],
)
def test_numbers_are_json_numbers_finite_and_bounded(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        DeploymentCreate.model_validate({**DEPLOYMENT, field: value})
    [error] = info.value.errors()
    assert error["loc"] == (field,) and message in validation.message(error), error


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"speculative_config": {"x": float("nan")}}, "finite"),
        ({"speculative_config": "x" * MAX_ENGINE_PARAMS_BYTES}, f"{MAX_ENGINE_PARAMS_BYTES} bytes"),
    ],
)
def test_engine_params_are_finite_and_bounded_in_size(params: dict[str, Any], message: str) -> None:
    for model, body in ((DeploymentCreate, {**DEPLOYMENT}), (DeploymentUpdate, {})):
        with pytest.raises(ValidationError) as info:
            model.model_validate({**body, "engine_params": params})
        [error] = info.value.errors()
        assert error["loc"] == ("engine_params",) and message in validation.message(error)


@pytest.mark.parametrize(
    ("engine", "params", "message"),
    [
        ("trtllm", {"--help": True}, "engine_params --help"),
        ("trtllm", {"tp_size": True}, "tp_size must be an integer"),
        ("trtllm", {"backend": {}}, "engine_params.backend {}: expected one of"),
        ("trtllm", {"kv_cache_free_gpu_memory_fraction": 1.5}, "must be in (0, 1]"),
        ("vllm", {"tp_size": 2}, "engine_params tp_size: vllm serve has no such option"),
        ("vllm", {"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ("sglang", {"max_num_seqs": 8}, "engine_params max_num_seqs"),
    ],
)
def test_engine_params_get_their_engines_check_as_a_rule(
    engine: str, params: dict[str, Any], message: str
) -> None:
    """Which options are valid depends on the engine: a rule across fields (400 from the API),
    with the engine's own check, naming the option."""
    spec = DeploymentCreate.model_validate(
        {**DEPLOYMENT, "engine": engine, "engine_params": params}
    )
    [problem] = spec.rule_problems()
    assert message in problem, problem


def test_rules_across_fields_are_problems_not_schema_errors() -> None:
    spec = DeploymentCreate.model_validate(
        {**DEPLOYMENT, "min_replicas": 5, "max_replicas": 2, "gpus_per_replica": 4}
    )
    assert spec.rule_problems() == [
        "min_replicas (5) exceeds max_replicas (2)",
        "gpus_per_replica (4) must equal tp_size × pp_size (2 × 1) for engine trtllm",
    ]


def _request_schema(openapi: dict[str, Any], name: str) -> dict[str, Any]:
    schema: dict[str, Any] = openapi["components"]["schemas"][name]
    return schema


def _allows_null(prop: dict[str, Any]) -> bool:
    return {"type": "null"} in prop.get("anyOf", ()) or prop.get("type") == "null"


def test_the_schema_offers_null_exactly_where_null_is_accepted() -> None:
    openapi = create_app(_settings(), db.make_engine("sqlite://"), migrate=False).openapi()
    for model, name in ((DeploymentUpdate, "DeploymentUpdate"), (ServerUpdate, "ServerUpdate")):
        props = _request_schema(openapi, name)["properties"]
        nullable = {field for field, prop in props.items() if _allows_null(prop)}
        assert nullable == set(model.nullable_fields), name
        for field in nullable:
            model.model_validate({field: None})  # accepted
    transition = _request_schema(openapi, "TransitionRequest")["properties"]["to"]
    assert transition["enum"] == ["draining", "enrolled", "maintenance", "retired"]
    # The rule "exactly one end" is in the schema, so a body without one is schema-invalid.
    assert "oneOf" in _request_schema(openapi, "ScheduleEntryCreate")


# What the edge refuses (fleet/api/edge.py): C0, DEL, C1.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
REF = "#/components/schemas/"


def _request_string_schemas(openapi: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(place, schema) of every schema a JSON request reaches that admits strings."""
    components = openapi["components"]["schemas"]
    pending: list[tuple[str, Any]] = []
    for path, item in openapi["paths"].items():
        for method, operation in item.items():
            for parameter in operation.get("parameters", []):
                pending.append((f"{method} {path} {parameter['name']}", parameter["schema"]))
            for media, content in operation.get("requestBody", {}).get("content", {}).items():
                if media != "application/yaml":  # the YAML uploads: fleet/inventory checks them
                    pending.append((f"{method} {path} body", content["schema"]))
    seen: set[str] = set()
    while pending:
        place, schema = pending.pop()
        if not isinstance(schema, dict):
            continue
        if "$ref" in schema:
            name = schema["$ref"].removeprefix(REF)
            if name not in seen:
                seen.add(name)
                pending.append((name, components[name]))
            continue
        kind = schema.get("type")
        # A schema that says nothing of its value (a `oneOf` branch naming properties is no
        # string); `pattern` and `propertyNames` are what the document adds.
        annotations = {"title", "description", "default", "pattern", "propertyNames"}
        untyped = kind is None and set(schema) <= annotations
        strings = kind == "string" or (isinstance(kind, list) and "string" in kind) or untyped
        if strings and "enum" not in schema and "const" not in schema:
            yield place, schema
        if (kind == "object" or untyped or (isinstance(kind, list) and "object" in kind)) and (
            schema.get("additionalProperties") is not False
        ):
            yield f"{place} (keys)", schema.get("propertyNames", {})
        for key in ("anyOf", "oneOf", "allOf"):
            pending.extend((place, sub) for sub in schema.get(key, []))
        for key in ("items", "additionalProperties"):
            pending.append((f"{place}.{key}", schema.get(key)))
        pending.extend((f"{place}.{n}", sub) for n, sub in schema.get("properties", {}).items())


def _matches_a_control_character(pattern: str) -> bool:
    """Whether hypothesis finds a string with a control character that `pattern` matches."""
    try:
        find(
            # `$` as schemathesis reads it (and JSON Schema means it): the end, no newline after.
            st.from_regex(re.sub(r"\$$", r"\\Z", pattern)),
            lambda text: CONTROL.search(text) is not None,
            settings=settings(
                max_examples=300, database=None, suppress_health_check=list(HealthCheck)
            ),
        )
    except NoSuchExample:
        return False
    return True


def test_every_string_a_request_carries_excludes_control_characters() -> None:
    """The edge refuses them with 422, so the schema says so: schema-valid is accepted."""
    openapi = create_app(_settings(), db.make_engine("sqlite://"), migrate=False).openapi()
    patterns: dict[str, str] = {}
    for place, schema in _request_string_schemas(openapi):
        if schema.get("format") == "date-time":
            continue
        assert "pattern" in schema, place
        patterns.setdefault(schema["pattern"], place)
    assert NO_CONTROL in patterns
    for code in [*range(0x20), *range(0x7F, 0xA0)]:
        assert re.search(NO_CONTROL, f"ok{chr(code)}ok") is None, code
    assert re.search(NO_CONTROL, "ok ünïcode ok") is not None
    for pattern, place in patterns.items():
        assert not _matches_a_control_character(pattern), (place, pattern)
    # The agents' URL pattern was `\S+`: narrowed, it still takes a URL.
    agent_url = openapi["components"]["schemas"]["Registration"]["properties"]["agent_url"]
    assert re.search(agent_url["anyOf"][0]["pattern"], "http://10.0.0.7:8000/x?y=1")


def test_integral_numbers_are_integers_where_the_schema_says_integer() -> None:
    """JSON Schema's integer takes 2.0 (JSON has one number type): so do the bodies."""
    spec = DeploymentCreate.model_validate(
        {**DEPLOYMENT, "engine_params": {"tp_size": 2.0, "pp_size": 1.0}}
    )
    assert spec.engine_params == {"tp_size": 2, "pp_size": 1}
    assert isinstance(spec.engine_params["tp_size"], int)
    spec = DeploymentCreate.model_validate({**DEPLOYMENT, "engine_params": {"tp_size": 2.5}})
    assert "tp_size must be an integer" in spec.rule_problems()[0]
    assert DeploymentLoad.model_validate({"waiting": 2.0}).waiting == 2
    for bad in (True, 2.5, "2"):
        with pytest.raises(ValidationError):
            DeploymentLoad.model_validate({"waiting": bad})


def test_every_bound_is_in_json_schema_words() -> None:
    """Pydantic writes the bounds of some optional fields as `gt`/`le`, which no reader of the
    schema knows (an inventory's `gpu.memory_mib: 0` was schema-valid); and a BMC port's range
    is stated."""
    openapi = create_app(_settings(), db.make_engine("sqlite://"), migrate=False).openapi()
    raw: list[str] = []

    def walk(node: Any, place: str) -> None:
        if isinstance(node, dict):
            raw.extend(f"{place}.{k}" for k in ("gt", "ge", "lt", "le") if k in node)
            for key, value in node.items():
                walk(value, f"{place}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{place}[{i}]")

    walk(openapi, "")
    assert raw == []
    port = openapi["components"]["schemas"]["BmcIn"]["properties"]["port"]
    assert (port["minimum"], port["maximum"]) == (1, 65535)


def test_inventory_bodies_are_the_inventory_file_schema() -> None:
    """The YAML bodies (uploads and export) are the file's mapping, not a string."""
    openapi = create_app(_settings(), db.make_engine("sqlite://"), migrate=False).openapi()
    inventory = {"$ref": REF + "InventoryFile"}
    for path in ("/inventory/import", "/inventory/validate"):
        body = openapi["paths"][API + path]["post"]["requestBody"]
        assert body["content"]["application/yaml"]["schema"] == inventory
        assert body["required"] is False  # an empty body is the empty inventory
    export = openapi["paths"][API + "/inventory/export"]["get"]["responses"]["200"]
    assert export["content"]["application/yaml"]["schema"] == inventory
    # The demo file is valid against it, and a string is not.
    schema = {"$ref": REF + "InventoryFile", "components": openapi["components"]}
    # Its strings refuse what the file's parser refuses: control characters, but for tabs and
    # newlines in a description.
    components = openapi["components"]["schemas"]
    address = components["BmcIn"]["properties"]["address"]["pattern"]
    description = components["SiteIn"]["properties"]["description"]["pattern"]
    assert re.search(address, "10.0.0.1") and not re.search(address, "10.0.0.1\x1b")
    assert re.search(description, "two\n\tlines") and not re.search(description, "a\x85b")
    validator = jsonschema_rs.validator_for(schema)
    assert validator.is_valid(yaml.safe_load(DEMO_INVENTORY.read_text()))
    assert not validator.is_valid("")


# ---------------------------------------------------------------------------------------------
# The API, live


@pytest.fixture(scope="module")
def live(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    with serve(engine, tmp_path_factory.mktemp("validation")) as server:
        yield server


@pytest.fixture
def operator(live: Live, db: Engine) -> Iterator[httpx.Client]:
    client = live.client(live.token(Role.OPERATOR))
    imported = client.post(
        f"{API}/inventory/import", content=DEMO_INVENTORY.read_bytes(), headers=YAML
    )
    assert imported.status_code == 200, imported.text
    yield client
    live.close_clients()


def refused(response: httpx.Response, status: int = 422) -> str:
    assert response.status_code == status, f"{response.request.url}: {response.text}"
    text: str = response.json()["detail"]
    return text


@pytest.mark.parametrize(
    "path",
    [
        "/schedules/4105051126726",
        "/schedules/4105051126726/preview",
        "/schedules/2147483648",
        "/events?until=0.5",
        "/events?since=9999-12-31T23:00:00-05:00",
    ],
)
def test_out_of_range_path_and_query_parameters_are_422(operator: httpx.Client, path: str) -> None:
    refused(operator.get(API + path))


def test_an_inventory_that_breaks_a_rule_is_400_and_one_of_the_wrong_form_422(
    operator: httpx.Client,
) -> None:
    """As for the API's own bodies: 422 breaks the schema, 400 a rule no schema states."""
    text = DEMO_INVENTORY.read_text()
    broken = text.replace("gpus_per_replica: 1", "gpus_per_replica: 3", 1)
    assert broken != text
    response = operator.post(f"{API}/inventory/validate", content=broken, headers=YAML)
    assert "gpus_per_replica (3) must equal" in refused(response, 400)
    wrong = text.replace("gpus_per_replica: 1", "gpus_per_replica: 0", 1)
    response = operator.post(f"{API}/inventory/validate", content=wrong, headers=YAML)
    assert "gpus_per_replica" in refused(response, 422)


def test_a_405_allows_every_method_of_the_path(operator: httpx.Client) -> None:
    """Starlette listed the methods of the first route of the path alone."""
    openapi = ok_json(operator.get("/openapi.json"))
    checked = 0
    for path, item in openapi["paths"].items():
        declared = {method.upper() for method in item}
        if "OPTIONS" in declared:
            continue
        concrete = re.sub(r"\{[^}]+\}", "1", path)
        response = operator.options(concrete)
        assert response.status_code == 405, (path, response.text)
        allowed = {m.strip() for m in response.headers["allow"].split(",")}
        assert allowed == declared, path
        checked += len(declared) > 1
    assert checked >= 5  # paths with more than one method, /deployments/{name} among them


def test_an_empty_inventory_body_is_the_empty_inventory(operator: httpx.Client) -> None:
    """As the schema says (an optional body): empty, or comments only, imports nothing; a
    document that is not a mapping (`null`, a string) is 422."""
    for text in ("", "# nothing yet\n"):
        report = ok_json(operator.post(f"{API}/inventory/validate", content=text, headers=YAML))
        assert report["changes"] == [], text
    for text in ("null\n", "''\n", "[]\n"):
        response = operator.post(f"{API}/inventory/validate", content=text, headers=YAML)
        assert refused(response).startswith("(top level): must be a mapping"), text


def ok_json(response: httpx.Response) -> Any:
    assert response.status_code == 200, f"{response.request.url}: {response.text}"
    return response.json()


def test_schedules_preview_is_post_only(operator: httpx.Client) -> None:
    """Not an entry named "preview" (a 422 for its id): a method the path does not take."""
    response = operator.get(f"{API}/schedules/preview")
    assert response.status_code == 405 and response.headers["allow"] == "POST", response.text


def test_out_of_range_and_boolean_bodies_are_422_naming_the_field(operator: httpx.Client) -> None:
    url = f"{API}/deployments"
    text = refused(operator.post(url, json={**DEPLOYMENT, "disruption_budget": 3_320_784_517}))
    assert text.startswith("body.disruption_budget: must be ≤")
    text = refused(operator.patch(f"{url}/llama-8b", json={"max_replicas": 2**40}))
    assert text.startswith("body.max_replicas: must be ≤")
    text = refused(operator.post(f"{url}/llama-8b/scale", json={"replicas": False}))
    assert text == "body.replicas: must be an integer"
    assert operator.get(f"{url}/llama-8b").json()["pinned_replicas"] is None
    # JSON's Infinity (Python's json reads it) is no number the fleet takes.
    body = json.dumps({**DEPLOYMENT, "sla_ttft_ms": float("inf")})
    headers = {"Content-Type": "application/json"}
    assert "sla_ttft_ms" in refused(operator.post(url, content=body, headers=headers))


def test_engine_params_are_checked_at_create_and_update(operator: httpx.Client) -> None:
    url = f"{API}/deployments"
    text = refused(operator.post(url, json={**DEPLOYMENT, "engine_params": {"--help": True}}), 400)
    assert "engine_params --help" in text and "trtllm-serve" in text, text
    big = {"speculative_config": "x" * (MAX_ENGINE_PARAMS_BYTES + 1)}
    text = refused(operator.patch(f"{url}/llama-8b", json={"engine_params": big}))
    assert text.startswith("body.engine_params:") and "bytes" in text
    # A rule across fields (no schema states it): 400.
    edit = {"engine_params": {"tp_size": 4}}
    assert "tp_size × pp_size" in refused(operator.patch(f"{url}/llama-8b", json=edit), 400)
    assert operator.get(f"{url}/llama-8b").json()["engine_params"]["tp_size"] == 1


def test_inventory_with_infinite_watts_is_refused(operator: httpx.Client) -> None:
    text = DEMO_INVENTORY.read_text().replace("max_w: 10200", "max_w: .inf", 1)
    assert ".inf" in text
    response = operator.post(f"{API}/inventory/import", content=text, headers=YAML)
    errors = response.json()["errors"]
    assert response.status_code == 422 and len(errors) == 1, response.text
    assert errors[0].endswith(".power.max_w: must be a finite number"), errors


# ---------------------------------------------------------------------------------------------
# Inventory files


def test_control_characters_are_refused_with_their_place() -> None:
    text = (
        "sites:\n"
        "  - name: s\n"
        '    description: "two\\nlines are fine"\n'
        "    racks:\n"
        '      - name: r\n        description: "bell\\a"\n'
        "servers:\n"
        '  - {name: x, rack: r, serial: "a\\x1b]0;pwned\\x07"}\n'
        '"key\\0": 1\n'
    )
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(text)
    assert info.value.errors == [
        "sites[0].racks[0].description: control characters are not allowed",
        "servers[0].serial: control characters are not allowed",
        "(top level): a key holds control characters",
    ]


def test_a_file_past_the_entry_bound_is_refused_before_it_is_built() -> None:
    text = "servers:\n" + "- {}\n" * (MAX_ENTRIES + 1)
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(text)
    [error] = info.value.errors
    assert error.startswith(f"servers[{MAX_ENTRIES}]: more than {MAX_ENTRIES} entries")


def test_errors_are_listed_up_to_a_bound_and_the_rest_counted() -> None:
    text = "servers:\n" + "- {name: ok, u: 0}\n" * 200  # each: 5 problems
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(text)
    errors = info.value.errors
    assert len(errors) == MAX_ERRORS + 1
    assert errors[-1] == f"… and {200 * 5 - MAX_ERRORS} more problems"


def test_a_bounded_error_list_says_how_many_problems_there_are() -> None:
    """The detail counts every problem, not the listed ones (issue 19)."""
    text = "servers:\n" + "- {name: ok, u: 0}\n" * 200  # each: 5 problems
    with pytest.raises(ValidationFailed) as info:
        parse_inventory(text)
    assert str(info.value).endswith(f"(and {200 * 5 - 1} more)")
    assert info.value.total == 200 * 5
    uncounted = ValidationFailed(["a", "b", "… and maybe more"], total=2, at_least=True)
    assert str(uncounted) == "a (and at least 1 more)"
    assert str(ValidationFailed(["a", "b"])) == "a (and 1 more)"
    assert str(ValidationFailed(["a"])) == "a"


def test_the_demo_inventory_still_parses() -> None:
    inv = parse_inventory(DEMO_INVENTORY.read_bytes())
    assert sum(len(rack.servers) for site in inv.sites for rack in site.racks) == 56


# ---------------------------------------------------------------------------------------------
# The CLI prints no control characters


HOSTILE = "drained\x1b]0;owned\x07 \x1b[2J\x9b31mred\x00\r\nforged line"
CLEAN = "drained]0;owned [2J31mred forged line"  # on one line


def test_cli_strips_control_characters_from_events_tables_and_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    row = {"at": "2026-01-01T00:00:00Z", "subject": "s1", "kind": "server.transition"}
    echo_event({**row, "to_state": None, "message": HOSTILE}, Output.TABLE)
    show([{"reason": HOSTILE}], Output.TABLE, [("reason", "REASON")])
    show({"reason": f"[link=http://evil]{HOSTILE}[/link]"}, Output.TABLE)
    with pytest.raises(typer.Exit):
        fail(HOSTILE)
    out, err = capsys.readouterr()
    for text in (out, err):
        assert not any(c in text for c in "\x1b\x07\x00\r\x9b"), repr(text)
    assert f"2026-01-01T00:00:00Z  s1  server.transition  {CLEAN}" in out
    assert "[link=http://evil]" in out  # printed as text, not read as rich markup
    assert err == f"error: {CLEAN}\n"


def test_cli_json_output_keeps_the_text_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    show([{"reason": HOSTILE}], Output.JSON)
    out = capsys.readouterr().out
    assert json.loads(out) == [{"reason": HOSTILE}] and "\x1b" not in out


# ---------------------------------------------------------------------------------------------


def _settings() -> Settings:
    return Settings(
        database_url="sqlite://", secret_key=SecretStr(TEST_SECRET_KEY.decode()), run_loops=False
    )
