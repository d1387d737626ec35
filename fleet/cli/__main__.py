"""`python -m fleet.cli`: the same as `fleetctl`."""

from fleet.cli import main

main()
