"""The pricing engine: pure (no I/O, no clocks of its own), shared by the live meter and `kvgate
billing simulate`."""
