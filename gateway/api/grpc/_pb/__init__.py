"""Generated gRPC stubs of `proto/kvgate/v1/gateway.proto` (`make proto`; do not edit)."""
