"""Model checkpoints without torch: Hugging Face folders, GGUF files and the shipped SmolLM2 resolved
to a `Checkpoint` (config, generation config, tokenizer, lazily opened weights). The engine loads
weights from it; the frontend, `serve` and the load generator read only its config and tokenizer."""
