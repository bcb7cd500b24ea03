"""What tests and benchmarks start: processes on free ports, redis-server and Redis Cluster."""
