"""Model files to a Checkpoint: Hugging Face folders, GGUF files, the shipped SmolLM2, sharded weights."""
