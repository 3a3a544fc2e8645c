"""The built-in torch engine: model loading, paged KV pool, scheduler, sampler.

Public entry points: `LLMEngine` (step-driven, one process per TP group) and
`open_checkpoint` (a model name, HF folder or GGUF file → weights + tokenizer).
"""
