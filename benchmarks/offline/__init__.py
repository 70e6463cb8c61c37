"""Our engine driven in this process (no HTTP): throughput and latency of batching modes, the prefill lane,
speculation, structured outputs, scheduling policies, one prompt at a time."""
