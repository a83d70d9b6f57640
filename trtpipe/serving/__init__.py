"""Serving: the in-flight batching executor (queue, capacity policy, micro-batches, paged KV pool, step loop)
shared by every front end (Triton twin model, OpenAI-compatible server, Python API) and every step engine
(reference runtime, one process per rank under mpirun, cost model in simulated time)."""
