"""The public entry point: the OpenAI-compatible HTTP API and the gRPC API of one router replica
(auth, admission, routing over verifier groups, Redis state, metrics), and the `outrider`
command (cli.py), which wires the layers below it together."""
