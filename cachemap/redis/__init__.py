"""The directory in Redis or Redis Cluster."""
