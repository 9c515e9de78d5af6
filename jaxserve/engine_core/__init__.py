"""The engine core in a process of its own and what it exchanges with the API process: the client, the core's loop,
their msgpack messages, cumulative outputs rebuilt from the core's deltas, and several cores behind one client
(data parallel)."""
