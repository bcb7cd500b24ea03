"""The request as every stage sees it: parsed, its cache hints, its tenant scope, its state (the
leaf: imports nothing else of the gateway)."""
