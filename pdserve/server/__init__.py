"""The OpenAI-compatible gateway: HTTP API, streaming, Prometheus metrics, `pdserve serve`."""
