"""meshnet_adapter: the Meshnet-facing side of dgr (backend surface, registration, admission,
route formation, route driver, relay framing). Meshnet itself is not in this repository."""
