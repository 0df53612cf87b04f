"""Helpers the tests import: models, batches, reference gradients, spawned-rank workers."""
