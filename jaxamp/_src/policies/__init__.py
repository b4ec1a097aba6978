"""The policy tables: one table per device type, rows keyed by primitive objects."""
