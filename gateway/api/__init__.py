"""The front ends: thin adapters from a wire format to the pipeline."""
