"""Tool calling on the chat API: the request's tools and tool_choice (choice.py, schema.py) and
the parsers that find calls in a model's output, whole and streamed (parsers.py, scan.py)."""
