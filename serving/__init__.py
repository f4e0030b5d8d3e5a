"""Command line and (later) the OpenAI-compatible server."""
