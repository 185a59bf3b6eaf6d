"""Rows to requests: validation, chat-template policy, windows, tokens, sort and buckets."""
