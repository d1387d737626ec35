"""Model versions and their files (docs/weights.md): the catalog service, and what a server's
assignment says about the version it serves or stages."""
