"""The OpenAI-compatible server: app.py (routes), protocol.py (schemas), streaming.py (SSE), metrics.py."""
