"""The OpenAI wire format: request and response bodies (pydantic) and errors."""
