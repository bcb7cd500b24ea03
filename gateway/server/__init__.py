"""The composition root: the app built from settings, its lifespan, `kvgate serve`."""
