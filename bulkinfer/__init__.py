"""bulkinfer: offline bulk inference for LLMs on vLLM."""

__version__ = "0.1.0"
