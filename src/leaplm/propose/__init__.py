"""Proposers: cheap guessers of the next K tokens. One module per method, built by registry.build_proposer."""
from .base import Proposal, ProposeContext, Proposer

__all__ = ["Proposal", "ProposeContext", "Proposer"]
