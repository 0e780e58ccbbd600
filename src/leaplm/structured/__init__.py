"""Structured output: constrain what a request generates to a JSON Schema, a regex, a list of choices or a grammar.

  config.StructuredOutput   the validated request field (compiled and checked by llguidance)
  state.py                  a request's grammar state under speculation: masks per verified position, forced tokens,
                            rollback (the engine's step applies them: engine/constrain.py)
"""
