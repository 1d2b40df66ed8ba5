"""The ops on a mesh: kernels per device (`per_device.batch_local`), the routed experts across
expert shards, the Engram tables' rows across their owners."""
