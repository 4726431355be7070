"""Serving a package in a server: micro-batching several requests into one package call
(``batching``) and a Triton Inference Server model repository around a package (``triton_repo``)."""
