"""The endpoint-picker front end: kvgate as a Gateway API Inference Extension endpoint picker
behind Envoy (ext-proc). Envoy carries the bytes; the picker admits, routes and records with the
same pipeline as the standalone gateway (`docs/deployment.md`)."""
