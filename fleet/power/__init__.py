"""Rack power: budgets (pure), rack views, power actions on servers, the reconciler."""
