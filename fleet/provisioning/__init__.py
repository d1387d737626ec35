"""Warm-spare provisioning: placement, boots, the per-state tick, remediation, the autopilot."""
