"""Errors the service raises with a meaning the API and CLI map to status codes."""

from __future__ import annotations


class FleetError(Exception):
    """Base: the message is what an operator needs to read."""

    status_code = 400


class NotFoundError(FleetError):
    status_code = 404


class ConflictError(FleetError):
    status_code = 409


class IllegalTransitionError(ConflictError):
    pass


class NotAnOperatorMove(FleetError):
    """A lifecycle move that only the fleet's own loops may make."""

    status_code = 422


class ValidationFailed(FleetError):
    """Input rejected; `errors` lists every problem with its place."""

    status_code = 422

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        head = errors[0] if errors else "invalid input"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(head + more)
