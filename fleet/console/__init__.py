"""The web console at /ui (docs/console.md): `session` (sign-in cookies and CSRF), `elevation`
and `charts` (what the pages draw, as plain data), `routes` (the pages), `templates/` and
`static/` (shipped in the package; no build step)."""
