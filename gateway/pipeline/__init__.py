"""One request's pipeline: admit → route → forward → record (the director and its steps)."""
