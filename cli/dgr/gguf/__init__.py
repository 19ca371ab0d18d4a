"""GGUF files: inspect, slice by layer range, synthesize, identify (manifests), runtime recipes, model locations."""
