"""The built-in torch engine: scheduler, paged KV pool, sampler, the step loop.

Public entry points: `BuiltinEngine` / `BuiltinEngineLauncher` (builtin.py: the engine contract of
services/engine_api over one `LLMEngine`), `LLMEngine` (engine.py; step-driven, one process per
TP group) and `open_model` (loading/smollm2.py: `--model` → checkpoint, the shipped SmolLM2
converted once). `model/` is the transformer, `loading/` the weights, `parallel/` the
tensor-parallel ranks, `kv_tiers/` the tiers below the block pool, `kernels/` the CPU kernel.
"""
