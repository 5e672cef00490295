"""Several engines behind one OpenAI-compatible endpoint: replicas, a router that sends
each request where its prompt's blocks are cached, and what happens when a replica
fails (docs/data_parallel.md)."""
