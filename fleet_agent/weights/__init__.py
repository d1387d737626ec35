"""The agent's weights cache (docs/weights.md): fetching model files from file://, http(s)://
and s3:// with sha256 checked while streaming, and the cache that holds them on local disk."""
