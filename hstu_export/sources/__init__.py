"""Model sources: bundles, the registry of models, a model's own export hints, input schemas inferred from an example call, and the model called on a flat request."""
