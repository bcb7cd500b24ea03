"""The simulated vLLM engine replica."""
