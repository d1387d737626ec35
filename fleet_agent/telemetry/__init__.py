"""GPU telemetry backends behind one snapshot shape (fleet_core/telemetry.py)."""
