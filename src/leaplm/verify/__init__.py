"""Verifiers: pure functions from (draft tokens, q or None, target p, generator) to what a step emits.

Vocabulary (as vLLM's): accepted = draft tokens the target agreed with; recovered = the token sampled from
the residual at the first rejection; bonus = the token sampled from p when every draft token was accepted.
Each step emits accepted + 1 tokens.
"""
from .coupled import verify_coupled, verify_tree_coupled
from .greedy import verify_greedy
from .rejection import residual, verify_rejection
from .result import VerifyResult
from .tree import verify_tree_greedy, verify_tree_rejection

__all__ = ["VerifyResult", "verify_greedy", "verify_rejection", "residual", "verify_tree_greedy",
           "verify_tree_rejection",
           "verify_coupled", "verify_tree_coupled"]
