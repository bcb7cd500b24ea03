"""The gateway: all of kvgate's I/O. HTTP (and later gRPC) front ends, auth, validation, the
director (admit → route → forward → record), replica health, the upstream proxy, the CLI."""
