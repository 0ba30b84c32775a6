"""Pure tensor math: attention over a paged KV cache, rotary embeddings, sampling transforms.

Nothing here imports Ray or does I/O; each kernel has a plain-torch reference test.
"""
