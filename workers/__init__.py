"""The Ray actors of the three pools (prefill, verifier, drafter) and the model code they share."""
