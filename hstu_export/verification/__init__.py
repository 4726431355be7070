"""Verification: the batches a package is checked on, its parity with the model, checking and timing an existing package."""
