"""Local test clusters: storage nodes (and etcd members) as processes on this machine."""
