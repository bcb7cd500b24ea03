"""OpenAI's chat and completions API (the default shape of the pipeline)."""
