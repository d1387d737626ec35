"""Rollouts of a new model version (docs/weights.md): canary steps judged against the stable
version, automatic rollback."""
