"""Drafters: propose draft tokens (and their probabilities q) for the verifier to check."""
