"""Text work, torch-free: tokenizer and chat template, incremental detokenization, stop strings, logprob text."""
