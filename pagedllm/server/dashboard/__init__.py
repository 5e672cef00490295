"""The live view of the block pool: ``GET /dashboard``, its event feed and the
kv-events stream (docs/dashboard.md)."""
