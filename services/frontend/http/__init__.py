"""The OpenAI-compatible HTTP API: the app, the generation routes, request schema and response bodies."""
