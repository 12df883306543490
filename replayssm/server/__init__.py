"""OpenAI-compatible HTTP server over the engine (needs the `server` extra).

Nothing is imported here, so `replayssm.server.launch` stays cheap for the CLI to import.
"""
