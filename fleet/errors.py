"""Errors the service raises with a meaning the API and CLI map to status codes."""

from __future__ import annotations


class FleetError(Exception):
    """Base: the message is what an operator needs to read."""

    status_code = 400


class NotFoundError(FleetError):
    status_code = 404


class ConflictError(FleetError):
    status_code = 409


class ForbiddenError(FleetError):
    """The caller's role may not do this (e.g. an operator changing BMC credentials)."""

    status_code = 403


class IllegalTransitionError(ConflictError):
    pass


class NotAnOperatorMove(FleetError):
    """A lifecycle move that only the fleet's own loops may make."""

    status_code = 422


class ValidationFailed(FleetError):
    """Input rejected; `errors` lists every problem with its place, or, past a bound, the first
    ones and a last line that says how many more there are."""

    status_code = 422

    def __init__(
        self, errors: list[str], *, total: int | None = None, at_least: bool = False
    ) -> None:
        """`total`: the number of problems when `errors` lists only some (its last line is then
        no problem but that count); `at_least`: the input has more, uncounted."""
        self.errors = errors
        self.total = len(errors) if total is None else total
        head = errors[0] if errors else "invalid input"
        more = self.total - 1
        some = f"at least {more}" if at_least else str(more)
        tail = f" (and {some} more)" if more > 0 else ""
        super().__init__(head + tail)


class RulesBroken(ValidationFailed):
    """Input that matches its schema but breaks rules no schema states (across fields, or
    against the fleet: an unknown rack, a duplicate name): 400, as the API's other rule
    problems; `errors` lists each with its place."""

    status_code = 400
