"""The built-in torch engine: scheduler, paged KV pool, sampler, the step loop.

Public entry points: `LLMEngine` (engine.py; step-driven, one process per TP group) and
`open_checkpoint` (loading/model_source.py: a model name, HF folder or GGUF file →
weights + tokenizer). `model/` is the transformer, `loading/` the model files,
`parallel/` the tensor-parallel ranks.
"""
