"""The gateway's side of the cache directory: deadlines, the local fallback, writes off the request
path."""
