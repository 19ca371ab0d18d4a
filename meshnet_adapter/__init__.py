"""meshnet_adapter: the Meshnet-facing side of dgr (backend surface, registration, route
formation). It sits on top of the ``dgr`` package (route driver: :mod:`dgr.route.driver`, relay
framing: :mod:`dgr.protocol.relay`), which never imports it. Meshnet itself is not in this
repository."""
