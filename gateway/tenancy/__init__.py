"""Tenants: API keys, policies, the tenants file and its CLI."""
