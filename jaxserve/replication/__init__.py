"""Multi-host serving: host 0 serves and schedules, and its runner calls are replayed on every other host (the
hosts' roles, and those calls as bytes)."""
