"""Scores of completions against references: BLEU, chrF, ROUGE, perplexity."""
