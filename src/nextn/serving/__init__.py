"""Serving nextn engines: an OpenAI-compatible server and a Triton Inference Server model repository."""

# A text prompt longer than this many characters per token of max_seq_len cannot fit: both servers refuse it before
# tokenizing (tokenizing 16 MB of text takes ~40 s of CPU). Real text averages 1-6 characters a token.
PROMPT_CHARS_PER_TOKEN = 32
