"""The Gu et al. timing audit of cache isolation."""
