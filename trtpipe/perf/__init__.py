"""Serving performance model: roofline step costs, fitted on NVIDIA's published TensorRT-LLM numbers, driven
through the executor's own scheduler in simulated time (``trtpipe predict``, ``trtpipe plan --slo``)."""
