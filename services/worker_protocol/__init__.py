"""The worker<->frontend contract, torch-free: sampling parameters, outputs, proto conversion, session framing."""
