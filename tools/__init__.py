"""Developer tooling (the Helm chart's checks, gRPC stub generation): not shipped in the image."""
