"""`POST /v1/messages`: Anthropic's Messages API over the pipeline."""
