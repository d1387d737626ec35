"""The OpenAPI document, told the rules the request edge enforces, and 405s that list every method.

FastAPI generates the document from the routes' models; two things it cannot know are added here,
once, when the document is first asked for:

- The edge (fleet/api/edge.py) refuses control characters (C0, DEL, C1) in the path, the query
  and every string of a JSON body, keys included. Every string a request may carry gets a
  pattern saying so (`NO_CONTROL`), and every object that takes keys of its choosing a
  `propertyNames` rule; a pattern already there that admits control characters (`\\S`) is
  narrowed; a value of any type (engine_params' pass-through options) is `CleanJsonValue`, the
  same rule at every depth. Only schemas a request reaches are changed: a response may carry
  what an inventory file brought in. The inventory file's parser refuses the same characters
  but lets a description hold tabs and newlines, and so does its schema.
- The inventory file's own schema (fleet/inventory/schema.py) for the YAML uploads and the
  export, whose bodies are YAML text of that object.

Starlette answers a method no route of a path takes with the `Allow` of the first route whose
path matched, so `/deployments/{name}` said `GET` alone though PATCH is a route too;
`AllowEveryMethod` lists each method the router would hand to a route of the schema.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from starlette.datastructures import MutableHeaders
from starlette.routing import BaseRoute, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.inventory.schema import MULTILINE_KEYS, InventoryFile

# What the edge refuses (its `_CONTROL`), in a pattern ECMA-262 and Python's `re` both read.
CONTROLS = "\\u0000-\\u001f\\u007f-\\u009f"
NO_CONTROL = f"^[^{CONTROLS}]*$"
# The same with tab and newline allowed: an inventory file's descriptions (its `CONTROL`).
NO_CONTROL_BUT_BREAKS = "^[^\\u0000-\\u0008\\u000b-\\u001f\\u007f-\\u009f]*$"
# `\S` admits every control character that is not whitespace (U+0000, ESC, DEL, most of C1).
_NOT_SPACE = "\\S"
_NOT_SPACE_OR_CONTROL = f"[^\\s{CONTROLS}]"
# Formats whose every valid string is free of control characters.
_CLEAN_FORMATS = frozenset({"date-time", "date", "time", "uuid", "email", "uri", "ipv4", "ipv6"})
REF = "#/components/schemas/"
YAML = "application/yaml"


def document(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """A replacement for `app.openapi`: FastAPI's document with the rules above, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = FastAPI.openapi(app)  # FastAPI's own, with all the app's settings; it caches
            add_inventory_schema(spec)
            exclude_controls(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    return openapi


def add_inventory_schema(spec: dict[str, Any]) -> None:
    """The inventory file's schema in the components; the YAML bodies (operations that carry
    `application/yaml`) refer to it."""
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    schema = InventoryFile.model_json_schema(ref_template=REF + "{model}")
    for name, definition in schema.pop("$defs", {}).items():
        # Shared enums (Pool, BmcProtocol, ...) are the same definition as the API's.
        components.setdefault(name, definition)
    components["InventoryFile"] = schema
    for operation in _operations(spec):
        body = operation.get("requestBody", {}).get("content", {}).get(YAML)
        if body is not None:
            body["schema"] = {"$ref": REF + "InventoryFile"}
        answer = operation.get("responses", {}).get("200", {}).get("content", {}).get(YAML)
        if answer is not None:
            answer["schema"] = {"$ref": REF + "InventoryFile"}


def exclude_controls(spec: dict[str, Any]) -> None:
    """Every string schema a request reaches refuses control characters (see above)."""
    components: dict[str, Any] = spec.setdefault("components", {}).setdefault("schemas", {})
    components[CLEAN_VALUE] = _clean_value()
    done: set[str] = {CLEAN_VALUE}
    json_bodies: list[Any] = []
    yaml_bodies: list[Any] = []
    for operation in _operations(spec):
        for parameter in operation.get("parameters", []):
            json_bodies.append(parameter.get("schema"))
        for media, content in operation.get("requestBody", {}).get("content", {}).items():
            (yaml_bodies if media == YAML else json_bodies).append(content.get("schema"))
    _walk(json_bodies, components, done)
    # The inventory file's parser refuses the same characters, but lets descriptions span lines
    # (fleet/inventory/schema.py): its export carries them so.
    for schema in _walk(yaml_bodies, components, done):
        for key in MULTILINE_KEYS:
            text = schema.get("properties", {}).get(key, {})
            if text.get("pattern") == NO_CONTROL:
                text["pattern"] = NO_CONTROL_BUT_BREAKS


def _walk(pending: list[Any], components: dict[str, Any], done: set[str]) -> list[dict[str, Any]]:
    """Apply `_refuse_controls` to every schema in `pending` and the components they refer to
    (those in `done` excepted, and then added); returns the schemas it changed."""
    seen: list[dict[str, Any]] = []
    while pending:
        node = pending.pop()
        for schema in _schemas(node):
            ref = schema.get("$ref")
            if isinstance(ref, str) and ref.startswith(REF):
                name = ref.removeprefix(REF)
                if name not in done and name in components:
                    done.add(name)
                    pending.append(components[name])
                continue
            _refuse_controls(schema)
            seen.append(schema)
    return seen


# Any JSON value without a control character in a string or key, at any depth: what an untyped
# value (engine_params' pass-through options) may be.
CLEAN_VALUE = "CleanJsonValue"
_CLEAN_REF = {"$ref": REF + CLEAN_VALUE}


def _clean_value() -> dict[str, Any]:
    return {
        "description": "any JSON value; no control characters in its strings or keys",
        "pattern": NO_CONTROL,
        "propertyNames": {"type": "string", "pattern": NO_CONTROL},
        "items": dict(_CLEAN_REF),
        "additionalProperties": dict(_CLEAN_REF),
    }


def _refuse_controls(schema: dict[str, Any]) -> None:
    if set(schema) <= _ANNOTATIONS:  # any value: the recursive rule
        schema.update(_clean_value())
        return
    if _admits(schema, "array") and "items" not in schema and "prefixItems" not in schema:
        schema["items"] = dict(_CLEAN_REF)
    if _admits(schema, "object") and schema.get("additionalProperties", True) is True:
        schema["additionalProperties"] = dict(_CLEAN_REF)
    if _admits(schema, "string") and "enum" not in schema and "const" not in schema:
        pattern = schema.get("pattern")
        if pattern is None:
            if schema.get("format") not in _CLEAN_FORMATS:
                schema["pattern"] = NO_CONTROL
        else:
            schema["pattern"] = narrowed(pattern)
    if _admits(schema, "object") and schema.get("additionalProperties") is not False:
        keys = schema.setdefault("propertyNames", {"type": "string"})
        keys["pattern"] = narrowed(keys["pattern"]) if "pattern" in keys else NO_CONTROL


def narrowed(pattern: str) -> str:
    """`pattern` without the control characters its `\\S` admits (other constructs in our
    patterns are explicit ASCII classes: tests/unit/test_validation.py checks each)."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            pair = pattern[i : i + 2]
            out.append(_NOT_SPACE_OR_CONTROL if pair == _NOT_SPACE else pair)
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def _admits(schema: dict[str, Any], kind: str) -> bool:
    """Whether `schema` lets a value of JSON type `kind` through its own `type` (no `type`:
    any, for keywords such as `pattern` then apply to that kind alone)."""
    declared = schema.get("type")
    if declared is None:
        # Only a schema that says nothing of its value is "any value" (a `oneOf` branch that
        # names a few properties is a constraint on an object, left alone).
        return set(schema) <= _ANNOTATIONS
    return declared == kind or (isinstance(declared, list) and kind in declared)


_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated"})
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "contains")


def _schemas(node: Any) -> Iterator[dict[str, Any]]:
    """`node` and every schema within it, `$ref`s not followed (the caller does)."""
    stack = [node]
    while stack:
        schema = stack.pop()
        if not isinstance(schema, dict):
            continue
        yield schema
        for key in _SUBSCHEMA_LISTS:
            stack.extend(schema.get(key, []))
        for key in _SUBSCHEMAS:
            stack.append(schema.get(key))
        stack.extend(schema.get("properties", {}).values())


_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _operations_of(item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for method in _METHODS:
        if method in item:
            yield item[method]


def _operations(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in spec.get("paths", {}).values():
        yield from _operations_of(item)


Methods = list[tuple[re.Pattern[str], frozenset[str], bool]]


def route_methods(routes: Sequence[BaseRoute]) -> Methods:
    """(path regex, methods, in the schema) of every route, in the order the router tries them:
    FastAPI keeps included routers unflattened, so its route contexts, not `app.routes`, have
    the paths with their prefixes."""
    table: Methods = []
    for context in iter_route_contexts(routes):
        if context.path and context.methods:
            regex, _, _ = compile_path(context.path)
            shown = bool(getattr(context, "include_in_schema", True))
            table.append((regex, frozenset(context.methods), shown))
    return table


def allowed_methods(table: Methods, path: str) -> list[str]:
    """Every method a route of `path` takes: for each method, the first route that takes it at
    this path answers it, and a route left out of the schema (one that only answers 405, such as
    GET /schedules/preview, which would otherwise reach /schedules/{entry_id}) allows nothing."""
    answered: dict[str, bool] = {}
    for regex, methods, shown in table:
        if regex.match(path):
            for method in methods:
                answered.setdefault(method, shown)
    return sorted(method for method, shown in answered.items() if shown)


class AllowEveryMethod:
    """On a 405, `Allow` lists the methods of every route of the path (see above)."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        # The application's route list itself: the routers are included after this is made,
        # so the table is built at the first 405.
        self.routes = routes
        self.table: Methods | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def listed(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                if self.table is None:
                    self.table = route_methods(self.routes)
                methods = allowed_methods(self.table, scope["path"])
                if methods:
                    MutableHeaders(scope=message)["Allow"] = ", ".join(methods)
            await send(message)

        await self.app(scope, receive, listed)
