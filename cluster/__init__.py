"""The engine spread over a Ray cluster: the deployment config, the runtime that places the
verifier, drafter and prefill pools as actors, the links and step channels between them, and
what the actors export (traces, metrics, logs). Built on workers/; the router sits above."""
