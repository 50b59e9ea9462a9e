"""Generated stubs of etcd's v3 API (KV, Watch, Lease; protos/flashfleet/etcd/) for the coordinator's etcd client."""
