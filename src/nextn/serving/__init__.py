"""Serving nextn engines: an OpenAI-compatible server and a Triton Inference Server model repository."""
