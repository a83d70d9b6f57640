"""HF -> TensorRT-LLM checkpoint conversion: reading (hf), splitting (shard), writing (writer), driving (convert)."""
