"""The plan of a comparison: config, model, data, recipe and the user's code, resolved and checked before any measurement."""
