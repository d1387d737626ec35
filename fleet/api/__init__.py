"""The REST API (`/api/v1`), health endpoints and Prometheus metrics."""

from fleet.api.app import create_app

__all__ = ["create_app"]
