"""Speculative decoding: drafters (n-gram, MTP, draft model, synthetic), verification, statistics.

Entry point for the engine: ``SpecDecoder`` (decode.py). Drafters implement ``Proposer``
(proposer.py); ``rejection_sample`` (verify.py) turns 1 + k target logits into accepted tokens.
"""
