"""The Shard wire protocol: boundary bundles, generated code checks, golden vectors, the worker client, relay framing."""
