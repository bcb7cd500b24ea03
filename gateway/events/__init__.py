"""Precise mode's event plumbing: the engines' KV events into the event index."""
