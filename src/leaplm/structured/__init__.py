"""Structured output: constrain what a request generates to a JSON Schema, a regex, a list of choices or a grammar.

  spec.py    StructuredOutput, the validated request field (compiled and checked by llguidance)
  state.py   a request's grammar state under speculation: masks per verified position, forced tokens, rollback

This package imports nothing from the engine (config.py imports spec.py), so the modules are imported by name.
"""
