"""Serving a package in a server: micro-batching several requests into one package call
(``batching``), the paged KV cache and the ranker that serves through it (``kv_cache``), and a Triton
Inference Server model repository around a package (``triton_repo``, ``triton_model``)."""
