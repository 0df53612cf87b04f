"""Course material: what the notebooks, benchmarks and examples use, apart from the library.

- ``models``: the tiny GPT and the MLP the course trains.
- ``data``: the shipped instruction data set, its byte tokenizer and collate.
- ``widgets``, ``plots``: notebook helpers (each built on a pure function tests call).
- ``exercises``: one checker module per notebook (``check``, ``hint``, ``solution``).
- ``environment``: is this machine ready for the course (``accumlab env --check``).
- ``workers``: the distributed worker functions notebooks, benchmarks and examples launch
  (spawned processes import them, so they live in a module, not in a notebook).

Nothing in the library (``accumlab`` outside this folder) imports from here.
"""
