"""Speculative decoding: drafters, acceptance rules, the verify-and-draft steps, the draft-length policy.

Every method is one module and one registry entry (`registry.py`); the engine builds what the registry returns and
talks to it through the protocol (`protocol.py`), never by type.
"""
