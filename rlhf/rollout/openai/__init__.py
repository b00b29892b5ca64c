"""The OpenAI-compatible endpoint agents reach the policy through: the server, the chat render, streaming."""
