"""`fleetctl models`: model versions and their files (docs/weights.md).

`create` takes a version from a YAML or JSON file (the body of `POST /api/v1/models`, the same
shape as an inventory file's `models:` entries), from `--artifact` flags, or from a local
directory whose files it hashes (`--from-dir DIR --base-uri URI`: each file's URI is the base
URI and its path, its sha256 and size are read from disk), so that publishing a checkpoint
already copied to a web server or bucket is one command.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from fleet.cli.common import (
    DEFAULT_URL,
    CliError,
    Out,
    Output,
    Token,
    Url,
    api_client,
    handled,
    show,
    typer_app,
)

models_app = typer_app("Model versions and their files (docs/weights.md).")
VERSION_COLUMNS = [
    ("key", "version"),
    ("description", "description"),
    ("files", "files #"),
    ("size_gb", "size GB"),
    ("external", "external"),
    ("created_by", "created by"),
    ("created_at", "created"),
]
HOLDER_COLUMNS = [
    ("server", "server"),
    ("state", "state"),
    ("gb", "GB"),
    ("verified_at", "verified"),
    ("error", "error"),
]
ARTIFACT_KEYS = (
    "name",
    "uri",
    "sha256",
    "size_bytes",
    "size",
    "format",
    "gpu_model",
    "tp_size",
    "tp",
)
_CHUNK = 8 << 20


def _split(key: str) -> tuple[str, str]:
    model, sep, version = key.partition("@")
    if not sep or not model or not version:
        raise CliError(f"{key!r}: expected <model>@<version>")
    return model, version


def _gb(size: int | None) -> float | None:
    return None if size is None else round(size / 1e9, 2)


@models_app.command("list")
@handled
def models_list(
    model: Annotated[str | None, typer.Option("--model", help="Only this model's.")] = None,
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """List model versions."""
    rows = list(api_client(url, token).pages("/api/v1/models", None, model=model))
    if output is Output.TABLE:
        rows = [
            {**r, "files": len(r.get("artifacts", [])), "size_gb": _gb(r.get("size_bytes"))}
            for r in rows
        ]
    show(rows, output, VERSION_COLUMNS)


@models_app.command("show")
@handled
def models_show(
    key: Annotated[str, typer.Argument(help="<model>@<version>")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """One version: its files, the deployments using it, the servers holding it."""
    model, version = _split(key)
    row = api_client(url, token).get(f"/api/v1/models/{model}/versions/{version}")
    show(row, output)


@models_app.command("where")
@handled
def models_where(
    key: Annotated[str, typer.Argument(help="<model>@<version>")],
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """The servers whose agents hold the version in their cache, and in which state."""
    model, version = _split(key)
    body = api_client(url, token).get(f"/api/v1/models/{model}/versions/{version}/servers")
    rows = body["results"]
    if output is Output.TABLE:
        rows = [{**r, "gb": _gb(r.get("bytes"))} for r in rows]
    show(rows, output, HOLDER_COLUMNS)


def _artifact_flag(text: str) -> dict[str, Any]:
    """`name=…,uri=…,sha256=…,size=…[,format=…,gpu_model=…,tp=…]` -> an artifact."""
    out: dict[str, Any] = {}
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or key not in ARTIFACT_KEYS:
            raise CliError(
                f"--artifact: expected KEY=VALUE pairs separated by commas, keys among "
                f"{', '.join(k for k in ARTIFACT_KEYS if k not in ('size', 'tp'))}"
            )
        key = {"size": "size_bytes", "tp": "tp_size"}.get(key, key)
        if key in ("size_bytes", "tp_size"):
            try:
                out[key] = int(value)
            except ValueError:
                raise CliError(f"--artifact: {key} must be a whole number") from None
        else:
            out[key] = value
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def artifacts_from_dir(root: Path, base_uri: str) -> list[dict[str, Any]]:
    """Every regular file under `root` (hidden ones aside), hashed, with the URI `base_uri`
    plus its relative path."""
    if not root.is_dir():
        raise CliError(f"--from-dir {root}: not a directory")
    base = base_uri if base_uri.endswith("/") else base_uri + "/"
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or any(p.startswith(".") for p in rel.split("/")):
            continue
        out.append(
            {
                "name": rel,
                "uri": base + rel,
                "sha256": _sha256(path),
                "size_bytes": path.stat().st_size,
            }
        )
    if not out:
        raise CliError(f"--from-dir {root}: no files")
    return out


@models_app.command("create")
@handled
def models_create(
    key: Annotated[str | None, typer.Argument(help="<model>@<version> (not with --file).")] = None,
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="YAML or JSON: model, version, artifacts.")
    ] = None,
    artifact: Annotated[
        list[str] | None,
        typer.Option("--artifact", help="name=…,uri=…,sha256=…,size=…[,format=…,gpu_model=…,tp=…]"),
    ] = None,
    from_dir: Annotated[
        Path | None, typer.Option("--from-dir", help="Hash the files of this directory.")
    ] = None,
    base_uri: Annotated[
        str | None, typer.Option("--base-uri", help="Where --from-dir's files are served.")
    ] = None,
    description: Annotated[str, typer.Option("--description")] = "",
    url: Url = DEFAULT_URL,
    token: Token = None,
    output: Out = Output.TABLE,
) -> None:
    """Create a model version (immutable: other files are another version)."""
    if file is not None:
        if key or artifact or from_dir:
            raise CliError("--file gives the whole version: no <model>@<version> or --artifact")
        try:
            body = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise CliError(f"--file {file}: {exc}") from None
        if not isinstance(body, dict):
            raise CliError(f"--file {file}: expected a mapping with model, version, artifacts")
    else:
        if key is None:
            raise CliError("give <model>@<version> with --artifact or --from-dir, or --file")
        model, version = _split(key)
        files = [_artifact_flag(a) for a in artifact or []]
        if from_dir is not None:
            if base_uri is None:
                raise CliError("--from-dir needs --base-uri (where agents fetch the files)")
            files += artifacts_from_dir(from_dir, base_uri)
        if not files:
            raise CliError("no files: give --artifact (repeat) or --from-dir")
        body = {"model": model, "version": version, "description": description, "artifacts": files}
    row = api_client(url, token).request("POST", "/api/v1/models", json=body)
    if output is Output.JSON:
        typer.echo(json.dumps(row, indent=2, default=str))
        return
    count, size = len(row["artifacts"]), row["size_bytes"]
    typer.echo(f"{row['key']}: {count} file(s), {size:,} bytes, {row['digest']}")


@models_app.command("delete")
@handled
def models_delete(
    key: Annotated[str, typer.Argument(help="<model>@<version>")],
    url: Url = DEFAULT_URL,
    token: Token = None,
) -> None:
    """Delete a version no deployment or server uses."""
    model, version = _split(key)
    api_client(url, token).request("DELETE", f"/api/v1/models/{model}/versions/{version}")
    typer.echo(f"{key}: deleted")
