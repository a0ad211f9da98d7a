"""The TensorRT-LLM KV cache connector.

``s3kv.connector.trtllm`` holds the classes users name in ``KvCacheConnectorConfig``; it is
the only module that imports ``tensorrt_llm``. ``s3kv.connector.api`` resolves the base
classes and data classes (TensorRT-LLM's when it imports, local stand-ins otherwise).
"""
