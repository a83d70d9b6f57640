"""One module per architecture family, each declaring its HF -> TensorRT-LLM mapping as data."""
