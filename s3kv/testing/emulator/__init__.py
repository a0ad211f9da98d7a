"""An emulated TensorRT-LLM runtime that proves the connector without TensorRT-LLM.

It runs a real Llama model (:mod:`s3kv.testing.emulator.model`) over a paged KV pool of exactly the
shape TensorRT-LLM hands to ``register_kv_caches`` and drives the connector through the
executor's call sequence. Importing this package imports nothing heavy; torch is imported by
the submodules that need it.
"""
