"""The engine replicas: health, discovery, their load signals."""
