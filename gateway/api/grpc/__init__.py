"""`kvgate.v1.Gateway` over gRPC."""
