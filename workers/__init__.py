"""The engine and what it runs, in one process and without Ray: the model code and its loaders
(`model/`), the paged KV cache (`kv_cache/`), the engine with its scheduler, speculation and
sampling (`engine/`), the drafters (`drafting/`) and the EAGLE head (`eagle/`). The Ray actors
that run it in pools are in cluster/."""
