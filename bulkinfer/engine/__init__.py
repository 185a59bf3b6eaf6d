"""The engine: the Engine protocol, vLLM behind it, and the one bounded feed loop."""
