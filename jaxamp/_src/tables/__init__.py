"""Policy tables, one module per device type."""
