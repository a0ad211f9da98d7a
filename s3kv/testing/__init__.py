"""Helpers for s3kv's tests, benchmarks and demos (real KV data from a small model)."""
