"""The OpenAI-compatible HTTP gateway: validates requests, applies the chat template, tokenizes,
streams the backend's tokens back as text (SSE). Never imports torch."""
