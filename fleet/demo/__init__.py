"""`fleetctl demo`: the whole fleet on the embedded default, in a few minutes (docs/demo.md)."""
