"""replayssm: a serving engine for hybrid state-space language models with ReplaySSM decoding."""

__version__ = "0.1.0"
