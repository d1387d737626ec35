"""GPU telemetry backends behind one snapshot shape (agents/telemetry/base.py)."""
